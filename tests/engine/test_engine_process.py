"""The engine process's start-up: an engine that refuses its arguments says why in the server's process, with its
own error, and leaves no process behind."""
from __future__ import annotations

import multiprocessing

import pytest

from fasterllm.config import EngineArgs
from fasterllm.engine.async_engine import AsyncLLM


def test_an_engine_that_refuses_its_arguments_raises_its_own_error_in_the_server_process():
    with pytest.raises(ValueError, match="max_model_len=10000000 exceeds the model's max_position_embeddings"):
        AsyncLLM.from_engine_args(EngineArgs(device="cpu", max_model_len=10**7))
    assert not [p for p in multiprocessing.active_children() if p.name == "fasterllm-engine"]


def test_a_server_whose_engine_process_died_can_still_send_without_blocking(tmp_path):
    """Between an engine process's death and the turn that reports it, the server's event loop may still send an
    add or an abort: it must queue, not block the loop (which would never read that turn)."""
    import signal
    import subprocess
    import sys
    import threading
    import time

    from fasterllm.engine.core_process import AttachedCore, core_endpoints
    from fasterllm.engine.engine_loop import AbortRequest
    from fasterllm.engine.engine_stats import EngineStats

    endpoints = core_endpoints(str(tmp_path), 1)
    engine = subprocess.Popen([sys.executable, "-c", (  # the engine process's end of the commands socket
        "import time; from fasterllm.engine.engine_process import zmq_socket; import zmq; "
        f"s = zmq_socket(zmq.Context(), zmq.PULL, bind={endpoints.commands[0]!r}); print(s.recv(), flush=True); "
        "time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    core = AttachedCore(EngineArgs(device="cpu"), endpoints, 0,
                        {"model_name": "m", "max_model_len": 512, "stats": EngineStats(*[0] * 11)})
    try:
        core._commands.send(b"hello")
        assert engine.stdout.readline().strip() == "b'hello'"  # connected
        engine.send_signal(signal.SIGKILL)
        engine.wait()
        time.sleep(0.3)
        sender = threading.Thread(target=core.send, args=(AbortRequest("r1"),), daemon=True)
        sender.start()
        sender.join(5)
        assert not sender.is_alive(), "send blocked on a dead engine process"
    finally:
        core.shutdown(timeout_s=1)
        if engine.poll() is None:
            engine.kill()
