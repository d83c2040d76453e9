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
