"""Fixtures for the server tests: the default model behind a real server, loaded once per session."""
from __future__ import annotations

import pytest
from server_utils import SERVER_ENGINE_ARGS, ServerThread


@pytest.fixture(scope="session")
def server():
    """As `fasterllm serve` runs: the engine in a process of its own."""
    from fasterllm.engine.async_engine import AsyncLLM
    from fasterllm.config import EngineArgs

    handle = ServerThread(AsyncLLM.from_engine_args(EngineArgs(**SERVER_ENGINE_ARGS)))
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def server_in_thread():
    """The engine on a thread of the test process: a test can reach into it (server.llm.engine) to make it fail."""
    from fasterllm.engine.async_engine import AsyncLLM
    from fasterllm.config import EngineArgs

    handle = ServerThread(AsyncLLM.from_engine_args(EngineArgs(**SERVER_ENGINE_ARGS), engine_process=False))
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def client(server):
    return server.client()


@pytest.fixture(scope="session")
def reference_llm():
    """The offline API on the same model and settings: what the server's greedy answers must equal."""
    from fasterllm import LLM

    return LLM(**SERVER_ENGINE_ARGS)
