"""The engine core in a process of its own, as vLLM runs it: the server's process keeps HTTP, prompt checks and
chat templates and the text of most requests (server_side_text.py); the engine process (engine_process.py) keeps
the Engine (scheduling, the forward pass, stop checks), so neither waits for the other's interpreter lock.

They talk over two ZeroMQ PUSH/PULL sockets on IPC paths: commands (add, abort, shutdown) one way, turns (accepted
adds, outputs as deltas (output_deltas.py), stats) the other, each message one pickle. The server side reads turns
in an asyncio task. ProcessCore starts its own engine process and watches its sentinel: an engine process that dies
is reported at once, and the engine process exits when the server's does. With several API server processes
(entrypoints/openai/api_servers.py) one process starts the engine and each API server attaches to it
(AttachedCore), with a pair of sockets of its own.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import pickle
import shutil
import tempfile
from collections.abc import Callable

import zmq
import zmq.asyncio

from fasterllm.config import EngineArgs
from fasterllm.engine.engine_loop import SHUTDOWN, AbortRequest, AddRequest, Turn
from fasterllm.engine.engine_process import CoreEndpoints, run_engine_process, zmq_socket
from fasterllm.engine.engine_stats import EngineStats
from fasterllm.engine.input_processor import InputProcessor
from fasterllm.engine.server_side_text import ServerSideText
from fasterllm.loader.checkpoint import open_checkpoint

logger = logging.getLogger("fasterllm")


def core_endpoints(socket_dir: str, num_servers: int) -> CoreEndpoints:
    return CoreEndpoints(ready=f"ipc://{socket_dir}/ready",
                         commands=[f"ipc://{socket_dir}/commands-{i}" for i in range(num_servers)],
                         turns=[f"ipc://{socket_dir}/turns-{i}" for i in range(num_servers)])


def start_engine_process(args: EngineArgs, endpoints: CoreEndpoints, idle_wait_s: float = 0.05,
                         visible_devices: str | None = None) -> multiprocessing.Process:
    """idle_wait_s: how long the idle engine waits for a command before it checks on its parent."""
    process = multiprocessing.get_context("spawn").Process(
        target=run_engine_process, name="fasterllm-engine",
        args=(args, endpoints, idle_wait_s, logging.getLogger("fasterllm").level, visible_devices))
    process.start()
    return process


def wait_until_ready(ready: zmq.Socket, process: multiprocessing.Process) -> dict:
    """The engine process's ready message (model name, max_model_len, stats); raises the error that stopped its
    start, or says that it exited."""
    while not ready.poll(200):
        if not process.is_alive():
            raise RuntimeError(f"the engine process exited with code {process.exitcode} while starting; "
                               "its log above says why")
    kind, body = pickle.loads(ready.recv())
    if kind == "failed":  # the engine's own error: a bad argument or model names its fix
        raise body
    return body


class AttachedCore:
    """Server process `index`'s end of the sockets to an engine process started elsewhere; `ready` is what that
    process reported. It is alive until a turn says the engine stopped; shutdown() closes this end only."""

    def __init__(self, args: EngineArgs, endpoints: CoreEndpoints, index: int, ready: dict | None = None):
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_turn: Callable[[Turn], None] | None = None
        self._reader: asyncio.Task | None = None
        self._dead = False
        self._zmq = zmq.Context()
        self._commands = zmq_socket(self._zmq, zmq.PUSH, connect=endpoints.commands[index])
        self._turns = zmq_socket(self._zmq, zmq.PULL, bind=endpoints.turns[index])
        if ready is not None:
            self._take_ready(open_checkpoint(args.model, args.tokenizer), ready)

    def _take_ready(self, checkpoint, ready: dict) -> None:
        self.tokenizer = checkpoint.tokenizer
        self.model_name = ready["model_name"]
        self.max_model_len = ready["max_model_len"]
        self.stats: EngineStats = ready["stats"]
        self.inputs = InputProcessor.for_model(self.tokenizer, checkpoint.config, self.max_model_len)
        self._outputs = ServerSideText(self.tokenizer, checkpoint.eos_token_ids)

    def start(self, on_turn: Callable[[Turn], None]) -> None:
        """Read turns on the event loop running now and hand them to on_turn."""
        self._loop = asyncio.get_running_loop()
        self._on_turn = on_turn
        turns = zmq.asyncio.Socket.shadow(self._turns.underlying)

        async def read() -> None:
            while self._take(await turns.recv()):
                pass

        self._reader = self._loop.create_task(read())

    def _take(self, message: bytes) -> bool:
        """Deliver one turn; False where this process could not (a bug on the server's side): the engine is then
        reported dead, so its requests fail and /health says why, instead of their waiting for ever."""
        try:
            self._deliver(message)
        except Exception as exc:
            logger.exception("the server could not take a turn of the engine; it stops serving")
            self._on_turn(Turn(dead_reason=f"the server could not take a turn of the engine: {exc!r}"))
            return False
        return True

    def _deliver(self, message: bytes) -> None:
        turn: Turn = pickle.loads(message)
        for request_id, error in turn.accepted:
            if error is not None:
                self._outputs.forget(request_id)
        turn.outputs = self._outputs.outputs(turn.outputs)
        self._dead = self._dead or turn.dead_reason is not None
        self._on_turn(turn)

    @property
    def alive(self) -> bool:
        return not self._dead

    def send(self, command) -> None:
        if isinstance(command, AbortRequest):
            self._outputs.forget(command.request_id)
        elif isinstance(command, AddRequest):
            self._outputs.expect(command.request_id, command.params)
        self._commands.send(pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL))

    def shutdown(self, timeout_s: float) -> None:
        self._stop_reading()
        self._zmq.destroy(linger=0)

    def _stop_reading(self) -> None:
        if self._reader is not None and not self._loop.is_closed():
            self._reader.cancel()


class ProcessCore(AttachedCore):
    """The one server process of an engine process it starts itself."""

    def __init__(self, args: EngineArgs, idle_wait_s: float = 0.05, visible_devices: str | None = None):
        """visible_devices: the GPUs the engine process may see (CUDA_VISIBLE_DEVICES there), None: as this one."""
        self._socket_dir = tempfile.mkdtemp(prefix="fasterllm-engine-")
        endpoints = core_endpoints(self._socket_dir, 1)
        super().__init__(args, endpoints, 0)
        ready = zmq_socket(self._zmq, zmq.PULL, bind=endpoints.ready)
        self._ready = False
        self.process = start_engine_process(args, endpoints, idle_wait_s, visible_devices)
        try:
            checkpoint = open_checkpoint(args.model, args.tokenizer)  # while the engine process loads the weights
            self._take_ready(checkpoint, wait_until_ready(ready, self.process))
            self._ready = True
        except BaseException:
            self.shutdown(timeout_s=5)
            raise
        finally:
            ready.close(linger=0)

    def start(self, on_turn: Callable[[Turn], None]) -> None:
        super().start(on_turn)
        self._loop.add_reader(self.process.sentinel, self._exited)

    def _exited(self) -> None:
        """The engine process is gone: hand on what it sent last (it may say why it stopped), then its exit."""
        self._loop.remove_reader(self.process.sentinel)
        self._reader.cancel()
        while self._turns.poll(100) and self._take(self._turns.recv()):
            pass
        self.process.join()
        self._on_turn(Turn(dead_reason=f"the engine process exited with code {self.process.exitcode}"))

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def shutdown(self, timeout_s: float) -> None:
        """Stop the engine process (killed if it does not stop within timeout_s) and close the sockets."""
        if self._reader is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.process.sentinel)
        self._stop_reading()
        stop_engine_process(self.process, self._commands if self._ready else None, timeout_s)
        self._zmq.destroy(linger=0)
        shutil.rmtree(self._socket_dir, ignore_errors=True)


def stop_engine_process(process: multiprocessing.Process, commands: zmq.Socket | None, timeout_s: float) -> None:
    """A SHUTDOWN command through commands (one of its command sockets: a ready engine stops after its step), or
    SIGTERM where commands is None (an engine that has not reported ready stops its load at once); killed if it is
    still there after timeout_s."""
    if not process.is_alive():
        return
    if commands is None:
        process.terminate()
    else:
        commands.send(pickle.dumps(SHUTDOWN), flags=zmq.NOBLOCK)  # queued whatever the engine's state
    process.join(timeout_s)
    if process.is_alive():
        logger.warning("the engine process did not stop within %.0f s; killing it", timeout_s)
        process.kill()
        process.join()
