"""Helpers for the parity tests: our model's logits step by step, transformers references, tiny models.

Nothing here is a fixture; tests/parity/conftest.py holds those.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch


# fp32 on both sides: we measured ~5e-5 on SmolLM2 and ~1e-6 on the tiny models
LOGITS_ATOL = 1e-3


# ---- our model, driven directly ---------------------------------------------------------------------

Step = Sequence[tuple[int, int]]  # (sequence index, number of new tokens) for every sequence in one forward


def forward_steps(model, seqs: Sequence[Sequence[int]], steps: Sequence[Step], block_size: int = 16
                  ) -> list[torch.Tensor]:
    """Run `model` over `seqs` in the given forward passes; return each sequence's logits, all positions.

    Each step is one flat batch (as the model runner builds it): sequence i contributes its next
    num_new tokens, attending to what earlier steps cached. Block tables are deliberately scattered
    (blocks handed out round-robin from the top of the pool down) so paging mistakes show up.
    """
    from fasterllm.layers.attention import AttentionMetadata

    cfg = model.config
    device = model.embed_tokens.weight.device
    dtype = model.embed_tokens.weight.dtype
    needed = [math.ceil(len(s) / block_size) for s in seqs]
    pool = list(reversed(range(sum(needed))))
    tables: list[list[int]] = [[] for _ in seqs]
    while pool:
        for i, count in enumerate(needed):
            if len(tables[i]) < count:
                tables[i].append(pool.pop(0))
    spec = model.kv_cache_specs()[0]  # what each layer caches per token (DeepSeek-V2: wider than cfg's heads say)
    kv = torch.zeros(cfg.num_hidden_layers, 2, sum(needed), block_size, spec.num_kv_heads, spec.head_dim,
                     dtype=dtype, device=device)
    done = [0] * len(seqs)
    pieces: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in steps:
        ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, step_tables = [], [], []
        for i, num_new in step:
            start, end = done[i], done[i] + num_new
            assert 0 < num_new and end <= len(seqs[i]), f"bad step {step}: sequence {i} has {len(seqs[i])} tokens"
            ids.extend(seqs[i][start:end])
            positions.extend(range(start, end))
            query_lens.append(num_new)
            seq_lens.append(end)
            step_tables.append(tables[i])
        meta = AttentionMetadata.build(query_lens, seq_lens, step_tables, block_size, device,
                                       model.config.sliding_window)
        with torch.inference_mode():
            logits = model(torch.tensor(ids, device=device), torch.tensor(positions, device=device), kv, meta,
                           torch.arange(len(ids), device=device))
        row = 0
        for i, num_new in step:
            pieces[i].append(logits[row:row + num_new].float().cpu())
            row += num_new
            done[i] += num_new
    for i, s in enumerate(seqs):
        assert done[i] == len(s), f"the steps cover {done[i]} of sequence {i}'s {len(s)} tokens"
    return [torch.cat(p) for p in pieces]


def full_logits(model, ids: Sequence[int], block_size: int = 16) -> torch.Tensor:
    """Logits of every position of one sequence, computed as one prefill."""
    return forward_steps(model, [ids], [[(0, len(ids))]], block_size)[0]


# ---- transformers references ------------------------------------------------------------------------

def hf_logits(hf_model, ids: Sequence[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([list(ids)])).logits[0].float()


def hf_greedy(hf_model, ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy `generate`, stopping at EOS as it normally does."""
    x = torch.tensor([list(ids)])
    with torch.inference_mode():
        out = hf_model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                max_new_tokens=max_new_tokens)
    return out[0, x.shape[1]:].tolist()


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    return (a - b).abs().max().item()


def first_divergence(ours: Sequence[int], ref: Sequence[int]) -> str:
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            return f"first difference at generated token {i}: ours {a}, transformers {b}"
    return f"lengths differ: ours {len(ours)}, transformers {len(ref)}"


# ---- watching the scheduler -------------------------------------------------------------------------

@dataclass
class ScheduledItem:
    request_id: str
    start: int  # tokens of the request already in the KV cache
    num_new: int
    prompt_len: int
    decode: bool  # one new token that was itself generated


@dataclass
class StepLog:
    steps: list[list[ScheduledItem]] = field(default_factory=list)

    @property
    def mixed_steps(self) -> int:
        """Forward passes holding both a prompt (chunk) and a decode token."""
        return sum(1 for s in self.steps if any(i.decode for i in s) and any(not i.decode for i in s))

    @property
    def continued_prompt_chunks(self) -> int:
        """Prompt chunks that start after earlier chunks of the same prompt (chunked prefill)."""
        return sum(1 for s in self.steps for i in s if not i.decode and 0 < i.start < i.prompt_len)


def watch_steps(monkeypatch, engine) -> StepLog:
    """Record what every forward pass of `engine` holds (wraps its executor's execute)."""
    log = StepLog()
    executor = engine.executor
    execute = executor.execute

    def spy(message):
        items = []
        for request_id, start, num_new in zip(message.request_ids, message.starts, message.num_new_tokens):
            r = engine.requests[request_id]
            decode = num_new == 1 and start == r.num_tokens - 1 and start >= len(r.prompt_token_ids)
            items.append(ScheduledItem(request_id, start, num_new, len(r.prompt_token_ids), decode))
        log.steps.append(items)
        return execute(message)

    monkeypatch.setattr(executor, "execute", spy)
    return log


def run_staggered(engine, prompts: Sequence[Sequence[int]], arrival_steps: Sequence[int], params,
                  max_steps: int = 10_000) -> dict[str, list[int]]:
    """Add prompt i (as request "staggered-i") just before engine step arrival_steps[i]; step until all
    finish. Returns request id -> generated token ids. On failure the requests are aborted, so a shared
    engine is left idle for the next test."""
    assert not engine.has_unfinished_requests(), "the engine must start idle"
    pending = sorted(range(len(prompts)), key=lambda i: arrival_steps[i])
    added: list[str] = []
    finished: dict[str, list[int]] = {}
    step = 0
    try:
        while pending or engine.has_unfinished_requests():
            while pending and arrival_steps[pending[0]] <= step:
                i = pending.pop(0)
                added.append(f"staggered-{i}")
                engine.add_request(added[-1], list(prompts[i]), params)
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = list(output.outputs[0].token_ids)
            step += 1
            assert step < max_steps, "the engine did not finish"
    except BaseException:
        for request_id in added:
            engine.abort_request(request_id)
        raise
    assert len(finished) == len(prompts), f"finished {sorted(finished)} of {len(prompts)} requests"
    return finished


NEW_TOKENS = 32  # generated per prompt in the greedy parity runs
# prompts of 3 to ~60 tokens for SmolLM2's staggered greedy runs (conftest's smollm2_prompts)
SMOLLM2_TEXTS = [
    "Once upon a",  # 3 tokens
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to synthesize "
    "foods from carbon dioxide and water. Photosynthesis in plants generally involves the green pigment "
    "chlorophyll and generates oxygen as a byproduct. The light reactions take place in the thylakoid "
    "membranes. In simple terms,",  # ~60 tokens
    "def fibonacci(n):\n    ",
    "In 1969, Neil Armstrong became the first person to walk on the Moon. The mission, called Apollo 11, was",
    "The recipe calls for",
    "1, 2, 3, 4, 5, 6,",
]


# ---- tiny random-weight checkpoints -----------------------------------------------------------------

@dataclass(frozen=True)
class TinySpec:
    name: str
    family: str  # tiny_config's key: llama, mistral, phi3, qwen2, qwen3, the Gemmas', the mixtures', deepseek_v2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    vocab_size: int = 384
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    rms_norm_eps: float = 1e-6
    shard: bool = False
    extra: dict = field(default_factory=dict)


HIDDEN, LAYERS, INTERMEDIATE, MAX_POS = 64, 2, 128, 256

TINY_SPECS = [
    TinySpec("llama3_gqa", "llama", num_heads=4, num_kv_heads=2, vocab_size=384,
             rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # head_dim * heads (128) != hidden (64): q/o projections are not square
    TinySpec("mistral_mqa", "mistral", num_heads=4, num_kv_heads=1, head_dim=32, vocab_size=320,
             rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, rms_norm_eps=1e-5,
             extra={"sliding_window": None}),
    TinySpec("qwen2_bias_tied", "qwen2", num_heads=4, num_kv_heads=2, vocab_size=512, tie_word_embeddings=True,
             rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
    TinySpec("llama_mha_tied_sharded_linear_rope", "llama", num_heads=4, num_kv_heads=4, vocab_size=256,
             tie_word_embeddings=True, shard=True, rms_norm_eps=1e-5,
             rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    # per-head RMSNorm on q and k before RoPE; head_dim * heads (96) != hidden (64)
    TinySpec("qwen3_qk_norm", "qwen3", num_heads=4, num_kv_heads=2, head_dim=24, vocab_size=448,
             rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
    # q/k/v and gate/up stored fused in the checkpoint
    TinySpec("phi3_fused", "phi3", num_heads=4, num_kv_heads=2, vocab_size=416, rms_norm_eps=1e-5,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, extra={"sliding_window": None}),
    # Phi-3 128k's LongRoPE: short factors below 160 positions (the prompts here), scaled by the attention factor of
    # 256 / 160 (positions from 160 on take the long factors: tests/layers/test_rotary.py)
    TinySpec("phi3_longrope", "phi3", num_heads=4, num_kv_heads=2, vocab_size=272, rms_norm_eps=1e-5,
             rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                              "short_factor": [1.0 + 0.3 * i for i in range(8)],
                              "long_factor": [2.0 + 0.5 * i for i in range(8)]},
             extra={"sliding_window": None, "original_max_position_embeddings": 160}),
    # GeGLU, (1 + weight) norms, four norms a layer, scaled embeddings, attention and final soft-capping, queries
    # scaled by query_pre_attn_scalar, an 8-token window on layer 0 only (prompts run far past it), tied head
    TinySpec("gemma2_softcap_window", "gemma2", num_heads=4, num_kv_heads=2, vocab_size=352, tie_word_embeddings=True,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
             extra={"sliding_window": 8, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 5.0,
                    "final_logit_softcapping": 20.0}),
    # Gemma 3: q/k norms of the (1 + weight) form, a RoPE per layer kind (the global layer's linearly scaled), the
    # 8-token window on layer 0, no soft-capping
    TinySpec("gemma3_local_global", "gemma3", num_heads=4, num_kv_heads=1, vocab_size=336, tie_word_embeddings=True,
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                              "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0}},
             extra={"sliding_window": 8, "query_pre_attn_scalar": 20,
                    "layer_types": ["sliding_attention", "full_attention"]}),
    # mixtures of experts: Mixtral (8 experts, top 2, renormalized), Qwen2-MoE (top 4 of 8, not renormalized, a
    # shared expert behind a sigmoid gate, q/k/v biases), Qwen3-MoE (top 2 of 6, renormalized, q/k norms, layer 1
    # dense)
    TinySpec("mixtral_moe", "mixtral", num_heads=4, num_kv_heads=2, vocab_size=304,
             rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, rms_norm_eps=1e-5,
             extra={"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 48,
                    "sliding_window": None}),
    TinySpec("qwen2_moe_shared", "qwen2_moe", num_heads=4, num_kv_heads=2, vocab_size=288,
             rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
             extra={"num_experts": 8, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
                    "shared_expert_intermediate_size": 80, "norm_topk_prob": False}),
    TinySpec("qwen3_moe_dense_layer", "qwen3_moe", num_heads=4, num_kv_heads=2, head_dim=24, vocab_size=320,
             rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
             extra={"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 40, "norm_topk_prob": True,
                    "mlp_only_layers": [1]}),
    # OLMoE: one RMSNorm over all query heads and one over all key heads, q/k/v clamped, top 3 of 6 not renormalized
    TinySpec("olmoe_clip", "olmoe", num_heads=4, num_kv_heads=4, vocab_size=296,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-5,
             extra={"num_experts": 6, "num_experts_per_tok": 3, "intermediate_size": 40, "norm_topk_prob": False,
                    "clip_qkv": 3.0}),
    # DeepSeek-V2-Lite's shape in small: latent attention with queries from q_proj, values (12) narrower than keys
    # (16 + 8), YaRN as the real config (mscale = mscale_all_dim: only the softmax scale changes), layer 0 dense,
    # top 3 of 8 experts plus 2 shared ones
    TinySpec("deepseek_v2_lite_yarn", "deepseek_v2", num_heads=4, num_kv_heads=4, vocab_size=328,
             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
                              "mscale_all_dim": 0.707, "original_max_position_embeddings": 64, "beta_fast": 32,
                              "beta_slow": 1},
             extra={"q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                    "v_head_dim": 12, "n_routed_experts": 8, "num_experts_per_tok": 3, "n_shared_experts": 2,
                    "moe_intermediate_size": 32, "first_k_dense_replace": 1}),
    # DeepSeek-V2's: queries through a rank-48 bottleneck, group_limited_greedy (top 3 within the best 2 of 4 groups)
    # times routed_scaling_factor 2.5, every layer experts, YaRN with mscale != mscale_all_dim (cos and sin scaled)
    TinySpec("deepseek_v2_q_lora_groups", "deepseek_v2", num_heads=4, num_kv_heads=4, vocab_size=344,
             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "mscale": 1.0,
                              "mscale_all_dim": 0.5, "original_max_position_embeddings": 32},
             extra={"q_lora_rank": 48, "kv_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
                    "v_head_dim": 20, "n_routed_experts": 8, "num_experts_per_tok": 3, "n_shared_experts": 1,
                    "moe_intermediate_size": 24, "first_k_dense_replace": 0, "topk_method": "group_limited_greedy",
                    "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}),
]


def tiny_config(spec: TinySpec, **overrides):
    from transformers import (DeepseekV2Config, Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig,
                              MixtralConfig, OlmoeConfig, Phi3Config, Qwen2Config, Qwen2MoeConfig, Qwen3Config,
                              Qwen3MoeConfig)

    cls = {"deepseek_v2": DeepseekV2Config, "gemma2": Gemma2Config, "gemma3": Gemma3TextConfig, "llama": LlamaConfig,
           "mixtral": MixtralConfig, "olmoe": OlmoeConfig, "qwen2_moe": Qwen2MoeConfig, "qwen3_moe": Qwen3MoeConfig,
           "mistral": MistralConfig, "phi3": Phi3Config, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[spec.family]
    kwargs = dict(vocab_size=spec.vocab_size, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                  num_hidden_layers=LAYERS, num_attention_heads=spec.num_heads,
                  num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim, max_position_embeddings=MAX_POS,
                  rms_norm_eps=spec.rms_norm_eps, tie_word_embeddings=spec.tie_word_embeddings,
                  rope_parameters=spec.rope_parameters, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kwargs.update(spec.extra)
    kwargs.update(overrides)
    return cls(**kwargs)


@torch.no_grad()
def randomize_(model, seed: int) -> None:
    """Weights large enough that attention is peaked and logits spread: a wrong RoPE, mask or bias shows.

    (transformers' default init, std 0.02, gives near-uniform attention and logits near 0, under which
    many bugs would hide inside a 1e-3 tolerance.)
    """
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * noise)
        elif name.endswith(".bias"):
            p.copy_(0.5 * noise)
        elif "embed_tokens" in name:
            p.copy_(noise)
        else:
            gain = 2.0 if (".q_proj." in name or ".k_proj." in name) else 1.5 if "lm_head" in name else 1.0
            p.copy_(noise * gain / math.sqrt(p.shape[1]))


def save_tiny_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer over 'w3 w4 ...' covering the whole vocabulary (our loader needs tokenizer.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(directory)


def build_tiny_model(spec: TinySpec, directory: Path, seed: int = 0, **overrides):
    """Create, randomize and save a tiny checkpoint (+ tokenizer) in `directory`; return the HF model (eval, fp32).
    overrides: config fields other than tiny_config's (wider layers)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(spec, **overrides), dtype=torch.float32)
    randomize_(model, seed)
    if spec.family == "qwen2":  # the q/k/v biases must be live, not zeros
        for layer in model.model.layers:
            assert layer.self_attn.q_proj.bias.abs().min() > 0
    if spec.family in ("qwen3", "gemma3"):  # the q/k norms must be live, not ones
        for layer in model.model.layers:
            assert (layer.self_attn.q_norm.weight != 1).all() and (layer.self_attn.k_norm.weight != 1).all()
    model.eval()
    save_kwargs = {"max_shard_size": "200KB"} if spec.shard else {}
    model.save_pretrained(directory, safe_serialization=True, **save_kwargs)
    save_tiny_tokenizer(directory, spec.vocab_size)
    return model


def random_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (length,), generator=g).tolist()


def assert_prompt_logprobs_match(llm, hf_model, prompts: Sequence[Sequence[int]], atol: float) -> None:
    """The engine's prompt logprobs of each prompt against transformers' (hf_model, fp32 on the CPU) within atol."""
    from fasterllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            reference = torch.log_softmax(hf_model(torch.tensor([list(prompt)])).logits[0].float(), dim=-1)
        ours = torch.tensor([next(iter(entry.values())).logprob for entry in output.prompt_logprobs[1:]])
        expected = reference[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        torch.testing.assert_close(ours, expected, atol=atol, rtol=0.02)
