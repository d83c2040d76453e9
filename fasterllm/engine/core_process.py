"""The engine core in a process of its own, as vLLM runs it: the server's process keeps HTTP, prompt checks and
chat templates and the text of most requests (server_side_text.py); this one keeps the Engine (scheduling, the forward
pass, stop checks), so neither waits for the other's interpreter lock.

They talk over two ZeroMQ PUSH/PULL sockets on IPC paths: commands (add, abort, shutdown) one way, turns (accepted
adds, outputs as deltas (output_deltas.py), stats) the other, each message one pickle. The server side reads turns
in an asyncio task and watches the process's sentinel: an engine process that dies is reported at once, and the
engine process exits when the server's does.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from fasterllm.config import EngineArgs
from fasterllm.engine.engine_loop import SHUTDOWN, AbortRequest, AddRequest, EngineLoop, Turn
from fasterllm.engine.engine_stats import EngineStats
from fasterllm.engine.frozen_heap import freeze_heap
from fasterllm.engine.input_processor import InputProcessor
from fasterllm.engine.output_deltas import OutputEncoder
from fasterllm.engine.server_side_text import ServerSideText
from fasterllm.loader.checkpoint import open_checkpoint

logger = logging.getLogger("fasterllm")

_PARENT_CHECK_S = 1.0  # how often a busy engine process checks that the server process is still there


class ProcessCore:
    def __init__(self, args: EngineArgs, idle_wait_s: float = 0.05, visible_devices: str | None = None):
        """visible_devices: the GPUs the engine process may see (CUDA_VISIBLE_DEVICES there), None: as this one."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_turn: Callable[[Turn], None] | None = None
        self._reader: asyncio.Task | None = None
        self._socket_dir = tempfile.mkdtemp(prefix="fasterllm-engine-")
        self._zmq = zmq.Context()
        self._commands = _socket(self._zmq, zmq.PUSH)
        self._commands.bind(f"ipc://{self._socket_dir}/commands")
        self._turns = _socket(self._zmq, zmq.PULL)
        self._turns.bind(f"ipc://{self._socket_dir}/turns")
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_process, name="fasterllm-engine",
            args=(args, self._socket_dir, idle_wait_s, logging.getLogger("fasterllm").level, visible_devices))
        self.process.start()
        try:
            checkpoint = open_checkpoint(args.model, args.tokenizer)  # while the engine process loads the weights
            self.tokenizer = checkpoint.tokenizer
            ready = self._wait_until_ready()
        except BaseException:
            self.shutdown(timeout_s=5)
            raise
        self.model_name = ready["model_name"]
        self.max_model_len = ready["max_model_len"]
        self.stats: EngineStats = ready["stats"]
        self.inputs = InputProcessor.for_model(self.tokenizer, checkpoint.config, self.max_model_len)
        self._outputs = ServerSideText(self.tokenizer, checkpoint.eos_token_ids)

    def _wait_until_ready(self) -> dict:
        while not self._turns.poll(200):
            if not self.process.is_alive():
                raise RuntimeError(f"the engine process exited with code {self.process.exitcode} while starting; "
                                   "its log above says why")
        kind, body = pickle.loads(self._turns.recv())
        if kind == "failed":  # the engine's own error: a bad argument or model names its fix
            raise body
        return body

    def start(self, on_turn: Callable[[Turn], None]) -> None:
        """Read turns on the event loop running now and hand them to on_turn."""
        self._loop = loop = asyncio.get_running_loop()
        self._on_turn = on_turn
        turns = zmq.asyncio.Socket.shadow(self._turns.underlying)

        async def read() -> None:
            while self._take(await turns.recv()):
                pass

        self._reader = loop.create_task(read())
        loop.add_reader(self.process.sentinel, self._exited)

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
        self._on_turn(turn)

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

    def send(self, command) -> None:
        if isinstance(command, AbortRequest):
            self._outputs.forget(command.request_id)
        elif isinstance(command, AddRequest):
            self._outputs.expect(command.request_id, command.params)
        self._commands.send(pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL))

    def shutdown(self, timeout_s: float) -> None:
        """Stop the engine process (killed if it does not stop within timeout_s) and close the sockets."""
        if self._reader is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.process.sentinel)
            self._reader.cancel()
        if self.process.is_alive():
            try:
                self._commands.send(pickle.dumps(SHUTDOWN), flags=zmq.NOBLOCK)
                self.process.join(timeout_s)
                if self.process.is_alive():
                    logger.warning("the engine process did not stop within %.0f s; killing it", timeout_s)
            except zmq.Again:  # still starting, not connected yet: nothing in it to finish
                pass
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        self._zmq.destroy(linger=0)
        shutil.rmtree(self._socket_dir, ignore_errors=True)


def run_engine_process(args: EngineArgs, socket_dir: str, idle_wait_s: float, log_level: int,
                       visible_devices: str | None = None) -> None:
    """The engine process: build the Engine, report ready (or the error that stopped it), then run the loop."""
    if visible_devices is not None:  # before anything here starts CUDA; its worker processes inherit it
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    from fasterllm.engine.engine import Engine

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server shuts this down
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("fasterllm").setLevel(log_level)
    context = zmq.Context()
    commands = _socket(context, zmq.PULL)
    commands.connect(f"ipc://{socket_dir}/commands")
    turns = _socket(context, zmq.PUSH)
    turns.connect(f"ipc://{socket_dir}/turns")
    try:
        engine = Engine(args, text_elsewhere=True)
    except Exception as exc:
        turns.send(pickle.dumps(("failed", _picklable(exc))))
        context.destroy(linger=5000)
        return
    freeze_heap()  # this process runs the engine until it exits: its start-up objects stay for good
    turns.send(pickle.dumps(("ready", {"model_name": engine.model_name, "max_model_len": engine.max_model_len,
                                       "stats": engine.stats()})))
    encoder = OutputEncoder()
    parent = multiprocessing.parent_process()
    last_check = time.monotonic()

    def receive(block: bool) -> list:
        nonlocal last_check
        received = []
        if (block and commands.poll(idle_wait_s * 1000)) or not block:
            while commands.poll(0):
                command = pickle.loads(commands.recv())
                if isinstance(command, AbortRequest):
                    encoder.forget(command.request_id)
                received.append(command)
        if time.monotonic() - last_check > _PARENT_CHECK_S or (block and not received):
            last_check = time.monotonic()
            if not parent.is_alive():  # the server is gone: nobody can send or read anything
                received.append(SHUTDOWN)
        return received

    def emit(turn: Turn) -> None:
        turn.outputs = encoder.encode(turn.outputs)
        turn.accepted = [(request_id, _picklable(error)) for request_id, error in turn.accepted]
        turns.send(pickle.dumps(turn, protocol=pickle.HIGHEST_PROTOCOL))

    try:
        EngineLoop(engine, receive, emit).run()
    finally:
        engine.shutdown()
        context.destroy(linger=5000)
        os._exit(0)  # the engine's threads (compile workers, Ray) must not hold the process open


def _socket(context: zmq.Context, kind: int) -> zmq.Socket:
    """No high-water mark: a burst of requests while the engine is busy queues up instead of blocking the server's
    event loop, and a server slow to read turns never stalls the engine."""
    socket = context.socket(kind)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    return socket


def _picklable(error: Exception | None) -> Exception | None:
    """The error itself when it survives pickling; otherwise a RuntimeError with its text."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
