"""Logit and tokenizer parity with transformers (fp32, CPU).

Our model is driven directly (parity_utils.forward_steps): as one prefill, as chunked prefill with
single-token steps in between, and as a flat batch mixing sequences at different stages, all against
transformers' full-sequence logits.
"""
from __future__ import annotations

import json

import pytest
import torch

from parity_utils import (LOGITS_ATOL, MAX_POS, TINY_SPECS, forward_steps, full_logits, hf_logits, max_abs_diff,
                          random_prompt, tiny_config)

transformers = pytest.importorskip("transformers")

SMOLLM2_TEXTS = [
    "What is the capital of France? The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "# The first ten Fibonacci numbers are",
]

# steps for three sequences of 60, 12 and 31 tokens: fresh prefills, single tokens over a cached
# context and a prompt chunk over a cached context, side by side in the same forward passes
MIXED_LENS = (60, 12, 31)
MIXED_STEPS = [[(0, 20), (1, 11)], [(0, 1), (1, 1), (2, 30)], [(0, 39), (2, 1)]]


def _chunked_steps(length: int) -> list[list[tuple[int, int]]]:
    """One sequence: a prompt chunk, two single tokens, chunks crossing block boundaries, the rest."""
    sizes = [5, 1, 1, 20, 13]
    assert sum(sizes) < length
    return [[(0, n)] for n in sizes + [length - sum(sizes)]]


# ---- SmolLM2 (GGUF, real weights) ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_prompts(smollm2_llm):
    tok = smollm2_llm.get_tokenizer()
    return [tok.encode(t) for t in SMOLLM2_TEXTS]


def test_smollm2_logits_match_transformers(smollm2_llm, hf_smollm2, smollm2_prompts):
    model = smollm2_llm.engine.executor.runner.model
    for ids in smollm2_prompts:
        ref = hf_logits(hf_smollm2, ids)
        ours = full_logits(model, ids)
        diff = max_abs_diff(ours, ref)
        print(f"smollm2 prefill T={len(ids)}: max |diff| = {diff:.2e}")
        assert diff < LOGITS_ATOL
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_smollm2_chunked_and_batched_logits_match_transformers(smollm2_llm, hf_smollm2, smollm2_prompts):
    model = smollm2_llm.engine.executor.runner.model
    ids = smollm2_prompts[1]
    assert len(ids) > 40, len(ids)
    ref = hf_logits(hf_smollm2, ids)
    diff = max_abs_diff(forward_steps(model, [ids], _chunked_steps(len(ids)))[0], ref)
    print(f"smollm2 chunked T={len(ids)}: max |diff| = {diff:.2e}")
    assert diff < LOGITS_ATOL

    long_ids = (ids * 2)[:MIXED_LENS[0]]
    seqs = [long_ids, smollm2_prompts[0][:MIXED_LENS[1]], ids[:MIXED_LENS[2]]]
    assert [len(s) for s in seqs] == list(MIXED_LENS)
    for i, ours in enumerate(forward_steps(model, seqs, MIXED_STEPS)):
        diff = max_abs_diff(ours, hf_logits(hf_smollm2, seqs[i]))
        print(f"smollm2 mixed batch seq {i}: max |diff| = {diff:.2e}")
        assert diff < LOGITS_ATOL


# ---- tiny random-weight models (safetensors directories) ----------------------------------------------

@pytest.fixture(scope="module")
def tiny_llms(tiny_checkpoints):
    from fasterllm import LLM

    return {name: LLM(str(directory), dtype="float32", device="cpu", max_model_len=MAX_POS, num_kv_blocks=32)
            for name, (directory, _) in tiny_checkpoints.items()}


@pytest.mark.parametrize("spec", TINY_SPECS, ids=lambda s: s.name)
def test_tiny_model_logits_match_transformers(spec, tiny_checkpoints, tiny_llms):
    directory, hf_model = tiny_checkpoints[spec.name]
    model = tiny_llms[spec.name].engine.executor.runner.model
    assert model.config.tie_word_embeddings == spec.tie_word_embeddings
    worst = 0.0
    for length, seed in ((7, 1), (100, 2)):
        ids = random_prompt(length, spec.vocab_size, seed)
        ref = hf_logits(hf_model, ids)
        assert ref.std() > 1.0, "the random weights are too small for a meaningful comparison"
        ours = full_logits(model, ids)
        worst = max(worst, max_abs_diff(ours, ref))
        if length > 40:
            chunked = forward_steps(model, [ids], _chunked_steps(length), block_size=8)[0]
            worst = max(worst, max_abs_diff(chunked, ref))
    seqs = [random_prompt(n, spec.vocab_size, 10 + n) for n in MIXED_LENS]
    for ours, ids in zip(forward_steps(model, seqs, MIXED_STEPS), seqs):
        worst = max(worst, max_abs_diff(ours, hf_logits(hf_model, ids)))
    print(f"{spec.name}: max |diff| = {worst:.2e}")
    assert worst < LOGITS_ATOL


def test_tiny_checkpoint_layouts(tiny_checkpoints):
    """The variants really are what they claim on disk: sharded with an index, tied without lm_head."""
    from safetensors import safe_open

    for spec in TINY_SPECS:
        directory, _ = tiny_checkpoints[spec.name]
        index = directory / "model.safetensors.index.json"
        assert index.is_file() == spec.shard, spec.name
        if spec.shard:
            shards = set(json.loads(index.read_text())["weight_map"].values())
            assert len(shards) > 1
        names = set()
        for path in directory.glob("*.safetensors"):
            with safe_open(str(path), framework="pt") as f:
                names.update(f.keys())
        assert ("lm_head.weight" in names) != spec.tie_word_embeddings, spec.name
        if spec.family == "qwen2":
            assert "model.layers.0.self_attn.q_proj.bias" in names
        if spec.family == "qwen3":
            assert "model.layers.0.self_attn.q_norm.weight" in names
        if spec.family == "phi3":
            assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"} <= names
        assert (directory / "tokenizer.json").is_file()


ONE_ROPE = {"rope_type": "default", "rope_theta": 10_000.0}


@pytest.mark.parametrize("family, changes", [
    ("gemma2", ({"sliding_window": 10_000}, {"attn_logit_softcapping": None}, {"final_logit_softcapping": None})),
    ("gemma3", ({"sliding_window": 10_000},
                {"rope_parameters": {"sliding_attention": ONE_ROPE, "full_attention": ONE_ROPE}})),
    ("olmoe", ({"clip_qkv": None},)),
])
def test_family_features_are_exercised(tiny_checkpoints, family, changes):
    """Without its window, its caps or its per-layer RoPE (a tiny Gemma), or its q/k/v clamp (OLMoE), a model answers
    far beyond the tolerance on a 100-token prompt, so the parity above checks them."""
    spec = next(s for s in TINY_SPECS if s.family == family)
    _, hf_model = tiny_checkpoints[spec.name]
    ids = random_prompt(100, spec.vocab_size, 2)
    reference = hf_logits(hf_model, ids)
    for change in changes:
        other = transformers.AutoModelForCausalLM.from_config(tiny_config(spec, **change), dtype=torch.float32).eval()
        other.load_state_dict(hf_model.state_dict())
        gap = max_abs_diff(hf_logits(other, ids), reference)
        print(f"{spec.name} with {change}: max |diff| = {gap:.2f}")
        assert gap > 100 * LOGITS_ATOL


def test_rope_scaling_is_exercised(tiny_checkpoints):
    """The llama3 / linear rope scalings change the logits far beyond the tolerance on a 100-token prompt,
    so the parity above really checks them (and our scaled logits match the scaled reference, not the plain one)."""
    for spec in TINY_SPECS:
        if spec.rope_parameters.get("rope_type", "default") == "default":  # Gemma 3's per-kind RoPE: tested above
            continue
        _, hf_model = tiny_checkpoints[spec.name]
        plain_config = tiny_config(spec, rope_parameters={"rope_type": "default",
                                                          "rope_theta": spec.rope_parameters["rope_theta"]})
        plain = transformers.AutoModelForCausalLM.from_config(plain_config, dtype=torch.float32).eval()
        plain.load_state_dict(hf_model.state_dict())
        ids = random_prompt(100, spec.vocab_size, 2)
        gap = max_abs_diff(hf_logits(plain, ids), hf_logits(hf_model, ids))
        print(f"{spec.name}: scaled vs unscaled rope, max |diff| = {gap:.2f}")
        assert gap > 100 * LOGITS_ATOL


@pytest.mark.parametrize("extra", [
    {"mlp_bias": True},
    {"attention_bias": True},
], ids=["mlp_bias", "attention_bias"])
def test_llama_bias_variants_match_transformers(extra, tmp_path):
    from fasterllm import LLM
    from parity_utils import TinySpec, build_tiny_model

    spec = TinySpec("llama_" + "_".join(extra), "llama", extra=extra)
    hf_model = build_tiny_model(spec, tmp_path, seed=11)
    assert any(name.endswith(".bias") for name, _ in hf_model.named_parameters())
    model = LLM(str(tmp_path), dtype="float32", device="cpu", max_model_len=MAX_POS,
                num_kv_blocks=32).engine.executor.runner.model
    ids = random_prompt(50, spec.vocab_size, 4)
    diff = max_abs_diff(full_logits(model, ids), hf_logits(hf_model, ids))
    print(f"{spec.name}: max |diff| = {diff:.2e}")
    assert diff < LOGITS_ATOL


SLIDING_WINDOW = 32


@pytest.fixture(scope="module")
def mistral_sliding(tmp_path_factory):
    """A Mistral checkpoint whose sliding_window (32) is shorter than the 100-token prompt: (ours, reference)."""
    from fasterllm import LLM
    from parity_utils import TinySpec, build_tiny_model

    spec = TinySpec("mistral_sliding", "mistral", num_heads=4, num_kv_heads=2, vocab_size=256,
                    extra={"sliding_window": SLIDING_WINDOW})
    directory = tmp_path_factory.mktemp("mistral_sliding")
    hf_model = build_tiny_model(spec, directory, seed=7)
    ids = random_prompt(100, spec.vocab_size, 3)
    model = LLM(str(directory), dtype="float32", device="cpu", max_model_len=MAX_POS,
                num_kv_blocks=32).engine.executor.runner.model
    return full_logits(model, ids), hf_logits(hf_model, ids)


def test_mistral_sliding_window_inside_window(mistral_sliding):
    ours, ref = mistral_sliding
    assert max_abs_diff(ours[:SLIDING_WINDOW], ref[:SLIDING_WINDOW]) < LOGITS_ATOL


def test_mistral_sliding_window_past_window(mistral_sliding):
    ours, ref = mistral_sliding
    diff = max_abs_diff(ours, ref)
    print(f"mistral sliding_window={SLIDING_WINDOW}, T=100: max |diff| = {diff:.2e}")
    assert diff < LOGITS_ATOL


# ---- the GGUF tokenizer and chat template -------------------------------------------------------------

TOKENIZER_TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing spaces  ",
    "multiple    spaces   between words",
    "   ",
    "line one\nline two\n\n\nline five\r\nwindows line",
    "\ttabbed\tand\n    indented code",
    "12345 and 3.14159, 1,000,000 and 2024-01-31",
    "Punctuation!?... (yes); [no] {maybe} \"quoted\" 'single' a-b_c/d\\e @#$%^&*",
    "don't I'll we've they're",
    "emoji 😀🎉👍🏽 and CJK 你好世界 日本語のテキスト 한국어",
    "ünïcödé façade naïve café",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text with <|endoftext|> inside",
    "x" * 50,
]


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_smollm2_tokenizer_encode_matches_transformers(smollm2_llm, hf_smollm2_tokenizer, add_special_tokens):
    ours = smollm2_llm.get_tokenizer()
    for text in TOKENIZER_TEXTS:
        assert ours.encode(text, add_special_tokens=add_special_tokens) == \
            hf_smollm2_tokenizer.encode(text, add_special_tokens=add_special_tokens), repr(text)


def test_smollm2_tokenizer_decode_round_trips(smollm2_llm, hf_smollm2_tokenizer):
    ours = smollm2_llm.get_tokenizer()
    for text in TOKENIZER_TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == \
                hf_smollm2_tokenizer.decode(ids, skip_special_tokens=skip), (repr(text), skip)


@pytest.mark.parametrize("messages", [
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Hi there!"}],
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
], ids=["system+user", "user", "multi-turn"])
def test_smollm2_chat_template_matches_transformers(smollm2_llm, hf_smollm2_tokenizer, messages):
    ours = smollm2_llm.get_tokenizer()
    text = ours.apply_chat_template(messages, add_generation_prompt=True)
    assert text == hf_smollm2_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert ours.encode(text, add_special_tokens=False) == hf_smollm2_tokenizer.encode(text, add_special_tokens=False)
