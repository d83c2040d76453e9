"""AsyncLLM: the server side of the engine. Requests go in and their outputs come out as asyncio queues, one per
request; the Engine itself runs in an engine core: its own process (core_process.ProcessCore, what `fasterllm
serve` runs) or a thread of this one (core_thread.ThreadCore). Either runs engine_loop.EngineLoop and hands each
turn's accepted adds and outputs back to the event loop, where this class delivers them.

A request's generator aborts its request when the consumer stops early (a client that disconnects), which frees its
KV blocks on the engine's next turn. An aborted id may be added again once the engine has applied the abort (its
turn says so): until then a turn already on its way may still carry the old request's outputs, which must not reach
the new one, so such an add waits for it.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fasterllm.config import EngineArgs
from fasterllm.engine.core_data_parallel import DataParallelCore
from fasterllm.engine.core_process import ProcessCore
from fasterllm.engine.core_thread import ThreadCore
from fasterllm.engine.engine_loop import AbortRequest, AddRequest, EngineDeadError, RequestFailedError, Turn
from fasterllm.engine.engine_stats import EngineStats
from fasterllm.outputs import RequestOutput
from fasterllm.sampling_params import BeamSearchParams, SamplingParams

__all__ = ["AsyncLLM", "EngineDeadError", "RequestFailedError"]


class AsyncLLM:
    """Use from one asyncio event loop."""

    def __init__(self, core: ProcessCore | ThreadCore | DataParallelCore):
        self.core = core
        self.stats: EngineStats = core.stats  # as of the engine's last turn
        self.dead_reason: str | None = None
        self._accepting: dict[str, asyncio.Future] = {}
        self._queues: dict[str, asyncio.Queue] = {}
        self._retiring: dict[str, asyncio.Future] = {}  # aborted ids whose abort the engine has not applied yet
        self._loop: asyncio.AbstractEventLoop | None = None  # the one start() ran on, where turns are delivered
        self._started = False

    @classmethod
    def from_engine_args(cls, args: EngineArgs, engine_process: bool = True) -> AsyncLLM:
        """engine_process: run the Engine in a process of its own (else on a thread of this one);
        args.data_parallel_size > 1: that many engine processes, each with its own copy of the model."""
        if args.data_parallel_size > 1:
            if not engine_process:
                raise ValueError(f"data_parallel_size={args.data_parallel_size} runs each replica in a process of its "
                                 "own; use engine_process=True or data_parallel_size=1")
            return cls(DataParallelCore(args))
        if engine_process:
            return cls(ProcessCore(args))
        from fasterllm.engine.engine import Engine

        return cls(ThreadCore(Engine(args)))

    @property
    def model_name(self) -> str:
        return self.core.model_name

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def tokenizer(self):
        """The model's tokenizer, in this process (the Rust tokenizer is safe to use from the event loop)."""
        return self.core.tokenizer

    @property
    def inputs(self):
        """The prompt checks (engine/input_processor.py), in this process."""
        return self.core.inputs

    @property
    def engine(self):
        """The Engine, when it runs in this process (ThreadCore)."""
        return self.core.engine

    @property
    def healthy(self) -> bool:
        return self.dead_reason is None and self._started and self.core.alive

    def start(self) -> None:
        """Start the engine loop; outputs are delivered to the event loop running now."""
        self._loop = asyncio.get_running_loop()
        self.core.start(self._on_turn)
        self._started = True

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self.core.shutdown(timeout_s)
        self._die(self.dead_reason or "the server is shutting down")

    async def add_request(self, request_id: str, prompt: str | list[int] | dict,
                          params: SamplingParams | BeamSearchParams, arrival_time: float | None = None) -> None:
        """Hand a request to the engine and wait until it is accepted; then read it with outputs().

        A beam search (BeamSearchParams) has one output, when it ends, with its best hypotheses.

        Raises ValueError for a request the engine refuses and EngineDeadError when it is not running.
        """
        while (retiring := self._retiring.get(request_id)) is not None:  # its outputs may still be on their way
            await asyncio.shield(retiring)
        if not self.healthy:
            raise EngineDeadError(f"the engine is not running: {self.dead_reason or 'not started'}")
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use; request ids must be unique")
        accepted = asyncio.get_running_loop().create_future()
        self._accepting[request_id] = accepted
        self._queues[request_id] = asyncio.Queue()
        self.core.send(AddRequest(request_id, prompt, params, arrival_time))
        try:
            await accepted
        except BaseException:
            self.abort(request_id)
            raise
        finally:
            self._accepting.pop(request_id, None)

    async def outputs(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Yield an added request's cumulative outputs until it finishes; stopping early aborts it. A consumer that
        falls behind gets the latest output only (it holds everything before it), as vLLM does: a stream then sends
        several tokens in one chunk instead of falling further behind.

        Raises RequestFailedError or EngineDeadError when the engine fails.
        """
        outputs = self._queues[request_id]
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                while not outputs.empty() and not isinstance(item, Exception) and not item.finished:
                    item = outputs.get_nowait()
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
        if self._queues.pop(request_id, None) is not None and self.dead_reason is None:
            if request_id not in self._retiring:
                self._retiring[request_id] = self._loop.create_future()
            self.core.send(AbortRequest(request_id))

    def _on_turn(self, turn: Turn) -> None:
        for request_id, error in turn.accepted:
            future = self._accepting.get(request_id)
            if future is None or future.done():  # done: the waiting coroutine was cancelled
                continue
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)
        for request_id, item in turn.outputs:
            outputs = self._queues.get(request_id)
            if outputs is not None:  # gone: its consumer stopped and has already asked for an abort
                outputs.put_nowait(item)
        for request_id in turn.aborted:  # no output of the aborted request follows: its id is free again
            retired = self._retiring.pop(request_id, None)
            if retired is not None:
                retired.set_result(None)
        if turn.stats is not None:
            self.stats = turn.stats
        if turn.dead_reason is not None:
            self._die(turn.dead_reason)

    def _die(self, reason: str) -> None:
        """Fail every request still waiting to be accepted or for outputs: nothing will answer them."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        for future in self._accepting.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        for outputs in self._queues.values():
            outputs.put_nowait(EngineDeadError(reason))
        for retiring in self._retiring.values():  # the adds waiting on them find the engine dead
            retiring.set_result(None)
        self._retiring.clear()
