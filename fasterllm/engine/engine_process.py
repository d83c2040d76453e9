"""The engine core process's side of core_process.py: build the Engine, report ready (or the error that stopped it),
then run the engine loop for one or more server processes.

Each server process (an API server) has its own pair of sockets: commands (PULL here) and turns (PUSH here). A
request's turns go back to the server that added it; the engine's stats and why it stopped go to every server. The
process stops on a SHUTDOWN command (after its step), or when the process that started it is gone; SIGTERM stops it
only while it loads the model.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import time
from dataclasses import dataclass

import zmq

from fasterllm.config import EngineArgs
from fasterllm.engine.engine_loop import SHUTDOWN, AbortRequest, AddRequest, EngineLoop, Turn
from fasterllm.engine.frozen_heap import freeze_heap
from fasterllm.engine.output_deltas import OutputEncoder

_PARENT_CHECK_S = 1.0  # how often a busy engine process checks that the process that started it is still there


@dataclass(frozen=True)
class CoreEndpoints:
    """ZeroMQ addresses between the engine process and its servers: where it reports ready (or failed), and each
    server process's commands (bound by the engine process) and turns (bound by the server; server i: commands[i],
    turns[i])."""
    ready: str
    commands: list[str]
    turns: list[str]


def run_engine_process(args: EngineArgs, endpoints: CoreEndpoints, idle_wait_s: float, log_level: int,
                       visible_devices: str | None = None) -> None:
    if visible_devices is not None:  # before anything here starts CUDA; its worker processes inherit it
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    from fasterllm.engine.engine import Engine

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server shuts this down
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("fasterllm").setLevel(log_level)
    context = zmq.Context()
    ready = zmq_socket(context, zmq.PUSH, connect=endpoints.ready)
    # bound here: a server's sends queue (never block) when this process is gone
    commands = [zmq_socket(context, zmq.PULL, bind=endpoint) for endpoint in endpoints.commands]
    turns = [zmq_socket(context, zmq.PUSH, connect=endpoint) for endpoint in endpoints.turns]
    try:
        engine = Engine(args, text_elsewhere=True)  # SIGTERM stops the load at once
    except Exception as exc:
        ready.send(pickle.dumps(("failed", picklable(exc))))
        context.destroy(linger=5000)
        return
    # from here on a SHUTDOWN command stops it, after its step, so that a SIGTERM to the whole process group
    # (systemd, `kill -- -PGID`) leaves the API servers' in-flight requests their shutdown timeout
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    freeze_heap()  # this process runs the engine until it exits: its start-up objects stay for good
    ready.send(pickle.dumps(("ready", {"model_name": engine.model_name, "max_model_len": engine.max_model_len,
                                       "stats": engine.stats()})))
    encoder = OutputEncoder()
    router = TurnRouter(len(turns))
    poller = zmq.Poller()
    for socket in commands:
        poller.register(socket, zmq.POLLIN)
    parent = multiprocessing.parent_process()
    last_check = time.monotonic()
    stopped = []  # a SHUTDOWN came: what is still unsent at exit has nobody waiting for it

    def receive(block: bool) -> list:
        nonlocal last_check
        received = []
        for socket, _ in poller.poll(idle_wait_s * 1000 if block else 0):
            server = commands.index(socket)
            while socket.poll(0):
                command = pickle.loads(socket.recv())
                if isinstance(command, AbortRequest):
                    encoder.forget(command.request_id)
                if isinstance(command, (AddRequest, AbortRequest)):
                    router.came_from(command, server)
                received.append(command)
        if time.monotonic() - last_check > _PARENT_CHECK_S or (block and not received):
            last_check = time.monotonic()
            if not parent.is_alive():  # whoever started this is gone: nobody can send or read anything
                received.append(SHUTDOWN)
        if SHUTDOWN in received:
            stopped.append(True)
        return received

    def emit(turn: Turn) -> None:
        for socket, part in zip(turns, router.split(turn)):
            part.outputs = encoder.encode(part.outputs)
            part.accepted = [(request_id, picklable(error)) for request_id, error in part.accepted]
            socket.send(pickle.dumps(part, protocol=pickle.HIGHEST_PROTOCOL))

    try:
        EngineLoop(engine, receive, emit).run()
    finally:
        engine.shutdown()
        context.destroy(linger=0 if stopped else 5000)  # else: let the turn that says why it stopped go out
        os._exit(0)  # the engine's threads (compile workers, Ray) must not hold the process open


class TurnRouter:
    """Which server process added each request still in the engine (and sent each abort not yet applied), and each
    server's part of a turn."""

    def __init__(self, num_servers: int):
        self.num_servers = num_servers
        self._server_of: dict[str, int] = {}
        self._abort_from: dict[str, int] = {}

    def came_from(self, command: AddRequest | AbortRequest, server: int) -> None:
        if self.num_servers == 1:  # one server gets every turn whole: nothing to remember on the step's path
            return
        if isinstance(command, AddRequest):
            self._server_of[command.request_id] = server
        else:  # its server waits to hear that it was applied, also when the request had ended meanwhile
            self._abort_from[command.request_id] = server

    def split(self, turn: Turn) -> list[Turn]:
        """One Turn per server: its requests' accepted adds and outputs, its aborts, and everyone's stats and
        dead_reason. Requests that end in this turn are forgotten."""
        if self.num_servers == 1:
            return [turn]
        parts = [Turn(stats=turn.stats, dead_reason=turn.dead_reason) for _ in range(self.num_servers)]
        for accepted in turn.accepted:
            parts[self._server_of[accepted[0]]].accepted.append(accepted)
        for request_id in turn.aborted:
            parts[self._abort_from[request_id]].aborted.append(request_id)
        for output in turn.outputs:
            parts[self._server_of[output[0]]].outputs.append(output)
        for request_id in turn.aborted:
            self._abort_from.pop(request_id, None)
        for request_id in turn.ended_request_ids():
            self._server_of.pop(request_id, None)
        return parts


def zmq_socket(context: zmq.Context, kind: int, connect: str | None = None, bind: str | None = None) -> zmq.Socket:
    """No high-water mark: a burst of requests while the engine is busy queues up instead of blocking the server's
    event loop, and a server slow to read turns never stalls the engine."""
    socket = context.socket(kind)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    if connect is not None:
        socket.connect(connect)
    if bind is not None:
        socket.bind(bind)
    return socket


def picklable(error: Exception | None) -> Exception | None:
    """The error itself when it survives pickling; otherwise a RuntimeError with its text."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
