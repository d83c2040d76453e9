"""`fasterllm serve --api-server-count N`: N HTTP server processes in front of one engine process, as vLLM's
--api-server-count runs them.

At a few hundred concurrent streams one server process spends most of a core on HTTP and server-sent events (about
60 us a streamed token, benchmarks/RESULTS.md) and falls behind the engine: its clients then get several tokens in
one late chunk. Here this process binds the listening socket, starts the engine process, and once it is ready
starts N API server processes that accept connections from the same socket. Each attaches to the engine with a
pair of sockets of its own (core_process.AttachedCore): its requests' tokens come back to it alone.

This process only watches: an engine process that dies is told to every API server (they answer 503 and /health
says why); an API server that dies stops the whole; SIGINT or SIGTERM stops the API servers (their in-flight
requests get shutdown_timeout_s), then the engine (a SHUTDOWN command: a SIGTERM to the whole process group does not
cut the in-flight requests short). /metrics adds up every API server's counters and shows the engine's latest
gauges (Prometheus' multiprocess mode, in a folder of this process's own).
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import socket
import tempfile
import threading

import zmq

from fasterllm.config import EngineArgs
from fasterllm.engine.core_process import (AttachedCore, core_endpoints, start_engine_process, stop_engine_process,
                                           wait_until_ready)
from fasterllm.engine.engine_loop import Turn
from fasterllm.engine.engine_process import CoreEndpoints, zmq_socket
from fasterllm.entrypoints.openai.server import ServeOptions

logger = logging.getLogger("fasterllm")

_KILL_AFTER_S = 10.0  # beyond the API servers' shutdown timeout, and for the engine's own shutdown


def run_api_servers(engine_args: EngineArgs, options: ServeOptions) -> None:
    if engine_args.data_parallel_size > 1:
        raise ValueError(f"--api-server-count {options.api_server_count} with --data-parallel-size "
                         f"{engine_args.data_parallel_size}: several API servers run in front of one engine "
                         "process; use one of the two settings")
    if options.embedding_model is not None:
        raise ValueError(f"--api-server-count {options.api_server_count} with --embedding-model: each API server "
                         "would load its own copy of the embedding model beside the engine's memory budget; serve "
                         "embeddings with --api-server-count 1")
    family = socket.AF_INET6 if ":" in options.host else socket.AF_INET
    listening = socket.create_server((options.host, options.port), family=family)  # a port in use fails first
    work_dir = tempfile.mkdtemp(prefix="fasterllm-serve-")
    endpoints = core_endpoints(work_dir, options.api_server_count)
    context = zmq.Context()
    engine, servers = None, []
    for signum in (signal.SIGINT, signal.SIGTERM):  # during the load: stop at once, the engine with it (finally)
        signal.signal(signum, _interrupt)
    try:
        engine = start_engine_process(engine_args, endpoints)
        ready = wait_until_ready(zmq_socket(context, zmq.PULL, bind=endpoints.ready), engine)
        stop = threading.Event()  # from here on a signal stops the API servers first, then the engine
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(work_dir, "metrics")  # the API servers inherit it
        os.mkdir(os.environ["PROMETHEUS_MULTIPROC_DIR"])
        spawn = multiprocessing.get_context("spawn")
        for index in range(options.api_server_count):
            servers.append(spawn.Process(target=_api_server, name=f"fasterllm-api-server-{index}", args=(
                engine_args, endpoints, index, ready, listening, options, logging.getLogger("fasterllm").level)))
            servers[-1].start()
        port = listening.getsockname()[1]
        listening.close()  # the API servers hold it now: once they stop, new connections are refused at once
        logger.warning("serving %s on http://%s:%d/v1 from %d API server processes (pids %s; engine process: "
                       "pid %d)", options.served_model_name or ready["model_name"], options.host, port,
                       len(servers), ", ".join(str(server.pid) for server in servers), engine.pid)
        _watch(engine, servers, endpoints, context, stop)
    finally:
        _stop(servers, engine, endpoints, context, options.shutdown_timeout_s)
        listening.close()
        context.destroy(linger=0)
        shutil.rmtree(work_dir, ignore_errors=True)


def _interrupt(*_) -> None:
    raise KeyboardInterrupt  # also for SIGTERM, and where the shell started this with SIGINT ignored


def _watch(engine: multiprocessing.Process, servers: list[multiprocessing.Process], endpoints: CoreEndpoints,
           context: zmq.Context, stop: threading.Event) -> None:
    """Until stop is set; exits (code 1, naming it) when an API server dies."""
    engine_sentinel = engine.sentinel
    while not stop.is_set():
        watched = [server.sentinel for server in servers] + ([] if engine_sentinel is None else [engine_sentinel])
        gone = multiprocessing.connection.wait(watched, timeout=0.2)
        for index, server in enumerate(servers):
            if server.sentinel in gone and not stop.is_set():
                server.join()
                raise SystemExit(f"error: API server process {index} exited with code {server.exitcode}; "
                                 "stopping the server")
        if engine_sentinel in gone:
            # on a pipe of its own, this can reach a server before the engine's last turns (the reason it may give)
            engine.join()
            reason = f"the engine process exited with code {engine.exitcode}"
            logger.error("%s; the API servers answer 503 until the server is stopped", reason)
            for address in endpoints.turns:
                zmq_socket(context, zmq.PUSH, connect=address).send(pickle.dumps(Turn(dead_reason=reason)))
            engine_sentinel = None


def _stop(servers: list[multiprocessing.Process], engine: multiprocessing.Process | None, endpoints: CoreEndpoints,
          context: zmq.Context, shutdown_timeout_s: float) -> None:
    """The API servers (SIGTERM: uvicorn lets in-flight requests finish), then the engine."""
    for server in servers:
        if server.is_alive():
            server.terminate()
    for server in servers:
        server.join(shutdown_timeout_s + _KILL_AFTER_S)
        if server.is_alive():
            logger.warning("%s did not stop in time; killing it", server.name)
            server.kill()
            server.join()
    if engine is not None:
        commands = zmq_socket(context, zmq.PUSH, connect=endpoints.commands[0]) if servers else None
        stop_engine_process(engine, commands, _KILL_AFTER_S)


def _api_server(engine_args: EngineArgs, endpoints: CoreEndpoints, index: int, ready: dict,
                listening: socket.socket, options: ServeOptions, log_level: int) -> None:
    """One API server process: the app on the shared socket, attached to the engine as server `index`."""
    from fasterllm.engine.async_engine import AsyncLLM
    from fasterllm.entrypoints.openai.server import serve_app

    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("fasterllm").setLevel(log_level)
    parent = multiprocessing.parent_process()
    threading.Thread(target=_stop_with, args=(parent.sentinel,), daemon=True).start()
    serve_app(AsyncLLM(AttachedCore(engine_args, endpoints, index, ready)), None, options, listening)


def _stop_with(parent_sentinel: int) -> None:
    """An API server whose starter is gone (killed) stops as SIGTERM stops it, instead of holding the port."""
    multiprocessing.connection.wait([parent_sentinel])
    os.kill(os.getpid(), signal.SIGTERM)
