"""DeepSeek-V2 beyond the shared family tests (test_logits.py, test_generation.py run its tiny specs): fp32 logits
within 1e-4 of transformers in a mixed batch, prefix-cache hits, the features the parity checks are sure to
exercise, what its KV cache holds, dummy weights, and the refusals (tensor parallelism, routing methods it does not
run)."""
from __future__ import annotations

import json

import pytest
import torch

from fasterllm import LLM, SamplingParams
from parity_utils import (LOGITS_ATOL, NEW_TOKENS, TINY_SPECS, first_divergence, forward_steps, hf_greedy, hf_logits,
                          max_abs_diff, random_prompt, tiny_config)

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
SPECS = {spec.name: spec for spec in TINY_SPECS if spec.family == "deepseek_v2"}
LATENT_ATTENTION_ATOL = 1e-4  # measured: ~5e-6


@pytest.mark.parametrize("name", sorted(SPECS))
def test_logits_of_a_mixed_batch_are_within_1e_4_of_transformers(tiny_checkpoints, name):
    """Three sequences in 8-token blocks: fresh prompts, single tokens over a cached context and a chunk over one,
    side by side in the same forward passes."""
    spec = SPECS[name]
    directory, hf_model = tiny_checkpoints[name]
    model = LLM(str(directory), dtype="float32", device="cpu", max_model_len=128,
                num_kv_blocks=32).engine.executor.runner.model
    seqs = [random_prompt(n, spec.vocab_size, 20 + n) for n in (60, 12, 31)]
    steps = [[(0, 20), (1, 11)], [(0, 1), (1, 1), (2, 30)], [(0, 39), (2, 1)]]
    for ours, ids in zip(forward_steps(model, seqs, steps, block_size=8), seqs):
        assert max_abs_diff(ours, hf_logits(hf_model, ids)) < LATENT_ATTENTION_ATOL


@pytest.mark.parametrize("name", sorted(SPECS))
def test_prompts_sharing_a_prefix_hit_the_cache_and_match_transformers(tiny_checkpoints, monkeypatch, name):
    spec = SPECS[name]
    directory, hf_model = tiny_checkpoints[name]
    monkeypatch.setattr(hf_model.generation_config, "eos_token_id", None)
    prefix = random_prompt(27, spec.vocab_size, 5)
    prompts = [prefix + random_prompt(n, spec.vocab_size, 50 + n) for n in (4, 13)]
    llm = LLM(str(directory), dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=32, block_size=8,
              max_num_batched_tokens=16)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)
    hits = llm.engine.stats().prefix_cache_hits
    second = llm.generate([{"prompt_token_ids": prompts[1]}], GREEDY, use_tqdm=False)
    assert llm.engine.stats().prefix_cache_hits >= hits + 3  # the shared prefix's three whole blocks
    for prompt, output in zip(prompts, (first, second)):
        ours, reference = list(output[0].outputs[0].token_ids), hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert ours == reference, first_divergence(ours, reference)


@pytest.mark.parametrize("name, change", [
    ("deepseek_v2_q_lora_groups", {"topk_method": "greedy"}),
    ("deepseek_v2_q_lora_groups", {"routed_scaling_factor": 1.0}),
    ("deepseek_v2_lite_yarn", {"first_k_dense_replace": 0}),
    ("deepseek_v2_lite_yarn", "without shared experts"),
])
def test_family_features_are_exercised(tiny_checkpoints, name, change):
    """Each of the routing method, the routed scale, the dense first layer and the shared experts changes a 100-token
    prompt's logits far beyond the tolerance, so the parity of these specs checks them (YaRN: test_logits.py's
    test_rope_scaling_is_exercised)."""
    spec = SPECS[name]
    _, hf_model = tiny_checkpoints[name]
    ids = random_prompt(100, spec.vocab_size, 2)
    config = tiny_config(spec, **change) if isinstance(change, dict) else tiny_config(spec)
    other = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    other.load_state_dict(hf_model.state_dict(), strict=False)  # a dense layer 0 turned MoE: its router etc. random
    if change == "without shared experts":
        for layer in other.model.layers[config.first_k_dense_replace:]:
            torch.nn.init.zeros_(layer.mlp.shared_experts.down_proj.weight)
    gap = max_abs_diff(hf_logits(other, ids), hf_logits(hf_model, ids))
    print(f"{name} with {change}: max |diff| = {gap:.2f}")
    assert gap > 100 * LOGITS_ATOL


def test_the_cache_holds_every_head_s_key_and_its_value_padded_to_the_key_s_width(tiny_checkpoints):
    """The expanded keys (nope + rope) and values zero-padded to that width: 2 * heads * (nope + rope) per token and
    layer, against heads * (nope + rope + v) unpadded."""
    directory, _ = tiny_checkpoints["deepseek_v2_lite_yarn"]
    llm = LLM(str(directory), dtype="float32", device="cpu", max_model_len=64, num_kv_blocks=8)
    specs = llm.engine.executor.runner.model.kv_cache_specs()
    extra = SPECS["deepseek_v2_lite_yarn"].extra
    key_width = extra["qk_nope_head_dim"] + extra["qk_rope_head_dim"]
    assert {(spec.kind, spec.num_kv_heads, spec.head_dim) for spec in specs} == {("full", 4, key_width)}
    assert specs[0].bytes_per_token(torch.float32) == 2 * 4 * key_width * 4


def test_dummy_weights_generate(tiny_checkpoints, tmp_path):
    directory, _ = tiny_checkpoints["deepseek_v2_q_lora_groups"]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((directory / name).read_bytes())
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", max_model_len=64, num_kv_blocks=8, load_format="dummy")
    output = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4,
                                                                          ignore_eos=True), use_tqdm=False)
    assert len(output[0].outputs[0].token_ids) == 4


def test_tensor_parallelism_is_refused_by_name(tiny_checkpoints):
    directory, _ = tiny_checkpoints["deepseek_v2_lite_yarn"]
    with pytest.raises(ValueError, match="tensor_parallel_size=2: DeepseekV2ForCausalLM .multi-head latent "
                                         "attention. runs on one device only.*use tensor_parallel_size=1"):
        LLM(str(directory), device="cpu", tensor_parallel_size=2)


@pytest.mark.parametrize("change, message", [
    ({"topk_method": "noaux_tc"}, "topk_method='noaux_tc' with scoring_func='softmax' is not supported"),
    ({"scoring_func": "sigmoid"}, "topk_method='greedy' with scoring_func='sigmoid' is not supported"),
    ({"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 1},
     "n_routed_experts=8 does not split into n_group=3 equal groups"),
])
def test_routing_it_does_not_run_is_refused_by_name(tiny_checkpoints, tmp_path, change, message):
    from fasterllm.loader.hf_checkpoint import load_hf_config

    directory, _ = tiny_checkpoints["deepseek_v2_lite_yarn"]
    config = json.loads((directory / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
        load_hf_config(tmp_path)
