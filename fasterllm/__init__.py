"""fasterllm: LLM inference and serving with a paged KV cache and continuous batching."""
from fasterllm.config import EngineArgs
from fasterllm.llm import LLM
from fasterllm.outputs import BeamSearchOutput, CompletionOutput, Logprob, RequestOutput
from fasterllm.sampling_params import BeamSearchParams, SamplingParams

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput", "BeamSearchOutput",
           "Logprob", "EngineArgs"]
__version__ = "0.1.0"
