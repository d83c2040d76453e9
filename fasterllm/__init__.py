"""fasterllm: LLM inference and serving with a paged KV cache and continuous batching."""
from fasterllm.config import EngineArgs
from fasterllm.llm import LLM
from fasterllm.outputs import CompletionOutput, Logprob, RequestOutput
from fasterllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "EngineArgs"]
__version__ = "0.1.0"
