"""AsyncLLM: the Engine's step loop on one background thread, one asyncio queue per request.

The Engine is synchronous and not thread-safe, so every Engine call happens on the loop thread:
the asyncio side hands it adds and aborts through a thread-safe queue and gets outputs back through
`loop.call_soon_threadsafe`. A request's generator aborts its request when the consumer stops early
(a client that disconnects), which frees its KV blocks on the next loop turn.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fasterllm.config import EngineArgs
from fasterllm.engine.engine import Engine
from fasterllm.engine.engine_stats import EngineStats
from fasterllm.errors import StepFailedError
from fasterllm.outputs import RequestOutput
from fasterllm.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger("fasterllm")


class EngineDeadError(RuntimeError):
    """The engine loop stopped (an unrecoverable error, or shutdown); no request can run."""


class RequestFailedError(RuntimeError):
    """The engine failed while running this request; other requests may go on."""


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams | BeamSearchParams
    arrival_time: float | None
    accepted: asyncio.Future


class AsyncLLM:
    """Owns an Engine and its loop thread. Use from one asyncio event loop."""

    def __init__(self, engine: Engine, idle_wait_s: float = 0.05):
        self.engine = engine
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.tokenizer = engine.tokenizer  # the Rust tokenizer is safe to use from the event loop thread
        self.inputs = engine.inputs  # the prompt checks: read-only, so also safe there
        self.dead_reason: str | None = None
        self.stats: EngineStats = engine.stats()  # refreshed by the loop thread after every turn
        self._idle_wait_s = idle_wait_s
        self._commands: queue.Queue[_Add | str | None] = queue.Queue()
        self._queues: dict[str, asyncio.Queue] = {}  # touched only on the event loop thread
        self._live: set[str] = set()  # touched only on the engine thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLM:
        return cls(Engine(args))

    @property
    def healthy(self) -> bool:
        return self.dead_reason is None and self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the loop thread; outputs are delivered to the event loop running now."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="fasterllm-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(None)
            self._thread.join(timeout_s)
        self.dead_reason = self.dead_reason or "the server is shutting down"

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | BeamSearchParams,
                          arrival_time: float | None = None) -> None:
        """Hand a request to the engine and wait until it is accepted; then read it with outputs().

        A beam search (BeamSearchParams) has one output, when it ends, with its best hypotheses.

        Raises ValueError for a request the engine refuses and EngineDeadError when it is not running.
        """
        if not self.healthy:
            raise EngineDeadError(f"the engine is not running: {self.dead_reason or 'not started'}")
        accepted = self._loop.create_future()
        self._queues[request_id] = asyncio.Queue()
        self._commands.put(_Add(request_id, prompt, params, arrival_time, accepted))
        try:
            if self.dead_reason is not None:  # the loop died after the check above and will not answer
                accepted.cancel()
                raise EngineDeadError(f"the engine is not running: {self.dead_reason}")
            await accepted
        except BaseException:
            self.abort(request_id)
            raise

    async def outputs(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Yield an added request's cumulative outputs until it finishes; stopping early aborts it.

        Raises RequestFailedError or EngineDeadError when the engine fails.
        """
        outputs = self._queues[request_id]
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)
            self._queues.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (a no-op for one that has finished)."""
        if self._queues.pop(request_id, None) is not None:
            self._commands.put(request_id)

    # ---- the loop thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                if not self._take_commands():
                    return
                if self.engine.has_unfinished_requests():
                    self._step()
                self.stats = self.engine.stats()
                if self.dead_reason is not None:
                    return
        except Exception as exc:  # a bug outside step(): nothing can be trusted any more
            logger.exception("engine loop crashed")
            self._die(f"engine loop crashed: {exc!r}")

    def _take_commands(self) -> bool:
        """Apply pending adds and aborts; wait for one when there is nothing to run. False: shut down."""
        block = not self.engine.has_unfinished_requests()
        while True:
            try:
                command = self._commands.get(timeout=self._idle_wait_s) if block else self._commands.get_nowait()
            except queue.Empty:
                return True
            block = False
            if command is None:
                self._die("the server is shutting down")
                return False
            if isinstance(command, str):
                self.engine.abort_request(command)
                self._live.discard(command)
            else:
                self._add(command)

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params, command.arrival_time)
        except Exception as exc:  # ValueError: a bad request, told to its client
            self._loop.call_soon_threadsafe(_resolve, command.accepted, exc)
            return
        self._live.add(command.request_id)
        self._loop.call_soon_threadsafe(_resolve, command.accepted, None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except StepFailedError as exc:  # the engine failed these requests whole and goes on
            failed = [rid for rid in exc.request_ids if rid in self._live]
            logger.error("engine step failed (%r); failed requests %s; the engine goes on", exc, failed)
            self._live.difference_update(failed)
            self._deliver([(rid, RequestFailedError(f"the engine failed while running request {rid}: {exc!r}"))
                           for rid in failed])
            return
        except Exception as exc:  # from outside the forward pass: the engine state is unknown
            logger.exception("engine step failed outside the forward pass; stopping the engine")
            self._die(f"engine step failed: {exc!r}")
            return
        for output in outputs:
            if output.finished:
                self._live.discard(output.request_id)
        self._deliver([(output.request_id, output) for output in outputs])

    def _die(self, reason: str) -> None:
        self.dead_reason = reason
        for request_id in list(self._live):
            self.engine.abort_request(request_id)
        self._deliver([(rid, EngineDeadError(reason)) for rid in self._live])
        self._live.clear()
        # adds still queued would otherwise wait forever
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                self._loop.call_soon_threadsafe(_resolve, command.accepted, EngineDeadError(reason))

    def _deliver(self, items: list[tuple[str, RequestOutput | Exception]]) -> None:
        if items:
            self._loop.call_soon_threadsafe(self._put_all, items)

    def _put_all(self, items: list[tuple[str, RequestOutput | Exception]]) -> None:
        for request_id, item in items:
            outputs = self._queues.get(request_id)
            if outputs is not None:  # gone: its consumer stopped and has already asked for an abort
                outputs.put_nowait(item)


def _resolve(future: asyncio.Future, error: Exception | None) -> None:
    if future.done():  # the waiting coroutine was cancelled
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
