"""On a GPU: the decoder families added after the Llama layer (Gemma 2's soft caps and per-layer window in the Triton
paged-attention kernel, Gemma 3's two RoPE tables, Phi-3's LongRoPE, the fused MoE kernels of Mixtral, Qwen2-MoE and
Qwen3-MoE, DeepSeek-V2's latent attention through the rotary kernel and the padded paged cache, its scaled and
group-limited routing), fp32 against transformers on the GPU: greedy tokens of a staggered batch with chunked prompts,
decode steps replayed from CUDA graphs (the mixtures of experts' too). The reference runs on the CPU.
Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from fasterllm import LLM
from parity_utils import NEW_TOKENS, TINY_SPECS, first_divergence, hf_greedy, random_prompt, run_staggered
from test_generation import GREEDY, TINY_ARRIVALS, TINY_PROMPT_LENGTHS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("transformers")


@pytest.mark.parametrize("name", ["gemma2_softcap_window", "gemma3_local_global", "phi3_longrope", "mixtral_moe",
                                  "qwen2_moe_shared", "qwen3_moe_dense_layer", "olmoe_clip", "deepseek_v2_lite_yarn",
                                  "deepseek_v2_q_lora_groups"])
def test_greedy_tokens_match_transformers_on_the_gpu(tiny_checkpoints, monkeypatch, name):
    spec = next(s for s in TINY_SPECS if s.name == name)
    directory, hf_model = tiny_checkpoints[name]
    prompts = [random_prompt(n, spec.vocab_size, 100 + n) for n in TINY_PROMPT_LENGTHS]
    monkeypatch.setattr(hf_model.generation_config, "eos_token_id", None)
    references = [hf_greedy(hf_model, ids, NEW_TOKENS) for ids in prompts]  # fp32 on the CPU
    llm = LLM(str(directory), dtype="float32", device="cuda", max_model_len=128, block_size=8,
              max_num_batched_tokens=8, max_num_seqs=3, gpu_memory_utilization=0.2)
    assert llm.engine.executor.runner.graphs is not None
    outputs = run_staggered(llm.engine, prompts, TINY_ARRIVALS, GREEDY)
    for i, reference in enumerate(references):
        ours = outputs[f"staggered-{i}"]
        assert ours == reference, f"prompt {i}: {first_divergence(ours, reference)}"
