"""Prefix caching, chunked prefill and preemption never change what a request generates (fp32, greedy), with the
KV cache in the model's dtype (identical tokens) and in fp8. Every path reads an fp8 cache's same e4m3 values back, but
fp32 noise between batch shapes (1e-6) can move a K value across an e4m3 rounding boundary (a 6% step): there the
tokens agree up to a near-tie, where the reference ranks the other token within NEAR_TIE nats of its own."""
import pytest

from fasterllm import LLM, SamplingParams

SYSTEM = ("You are a careful assistant. Answer briefly and precisely, and say so when you do not know. "
          "Prefer plain words over jargon.")
QUESTIONS = ["What is the capital of France?", "Name a prime number.", "Why is the sky blue?",
             "What is two plus two?"]
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
NEAR_TIE = 0.25  # the largest gap seen across chunk sizes 3..16 on SmolLM2 was 0.19


def prompts(llm):
    tokenizer = llm.get_tokenizer()
    return [tokenizer.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
            for q in QUESTIONS]


def generate_twice(max_model_len=256, **engine_args):
    """Two rounds of the same prompts: the second can hit the prefix cache the first filled."""
    llm = LLM(dtype="float32", max_model_len=max_model_len, **engine_args)
    batch = prompts(llm)
    rounds = [[o.outputs[0] for o in llm.generate(batch, PARAMS, use_tqdm=False)] for _ in range(2)]
    return rounds, llm.engine.stats()


def assert_same_answers(rounds, reference, kv_cache_dtype):
    for answers in rounds:
        for got, want in zip(answers, reference, strict=True):
            if kv_cache_dtype == "auto" or got.token_ids == want.token_ids:
                assert got.token_ids == want.token_ids
                continue
            first = next(i for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)) if a != b)
            ranked = want.logprobs[first]
            assert got.token_ids[first] in ranked, f"token {first}: {got.token_ids} against {want.token_ids}"
            gap = ranked[want.token_ids[first]].logprob - ranked[got.token_ids[first]].logprob
            assert gap <= NEAR_TIE, f"token {first}: not a near-tie ({gap:.3f} nats)"


@pytest.fixture(scope="module", params=["auto", "fp8"])
def kv_cache_dtype(request):
    return request.param


@pytest.fixture(scope="module")
def reference(kv_cache_dtype):
    rounds, stats = generate_twice(enable_prefix_caching=False, num_kv_blocks=200, kv_cache_dtype=kv_cache_dtype)
    assert_same_answers(rounds[1:], rounds[0], "auto")  # the same batch twice: the same tokens
    assert stats.prefix_cache_hits == 0 and stats.num_preemptions == 0
    return rounds[0]


def test_prefix_caching_gives_identical_tokens_and_hits(reference, kv_cache_dtype):
    rounds, stats = generate_twice(enable_prefix_caching=True, num_kv_blocks=200, kv_cache_dtype=kv_cache_dtype)
    assert_same_answers(rounds, reference, kv_cache_dtype)
    # the second round finds every full block of every prompt (about 47 tokens: 2 blocks of 16)
    assert stats.prefix_cache_hits >= len(QUESTIONS) * 2 * 16


@pytest.mark.parametrize("budget", [3, 16])  # 3: chunks end inside blocks, decodes wait for budget
def test_chunk_sizes_give_identical_tokens(reference, kv_cache_dtype, budget):
    rounds, _ = generate_twice(max_num_batched_tokens=budget, num_kv_blocks=200, kv_cache_dtype=kv_cache_dtype)
    assert_same_answers(rounds, reference, kv_cache_dtype)


@pytest.mark.parametrize("caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_identical_tokens(reference, kv_cache_dtype, mode, caching):
    # 10 blocks of 16 tokens: three ~47-token prompts are admitted (3 blocks each), then each needs a
    # fourth block for its answer, and only one is left
    rounds, stats = generate_twice(max_model_len=96, num_kv_blocks=10, preemption_mode=mode, swap_space_gib=0.05,
                                   enable_prefix_caching=caching, kv_cache_dtype=kv_cache_dtype)
    assert_same_answers(rounds, reference, kv_cache_dtype)
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_swapped_out > 0 and stats.num_swapped_in == stats.num_swapped_out
    assert stats.kv_cache_usage == 0.0  # everything freed at the end


def test_long_prefill_cap_gives_identical_tokens(reference, kv_cache_dtype):
    rounds, _ = generate_twice(long_prefill_token_threshold=8, num_kv_blocks=200, kv_cache_dtype=kv_cache_dtype)
    assert_same_answers(rounds, reference, kv_cache_dtype)


def test_a_shared_prefix_is_computed_once():
    llm = LLM(dtype="float32", max_model_len=256, num_kv_blocks=64)
    engine = llm.engine
    computed = []
    execute = engine.executor.runner.execute

    def counting_execute(message):
        computed.append(dict(zip(message.request_ids, message.num_new_tokens)))
        return execute(message)

    engine.executor.runner.execute = counting_execute
    first, second = prompts(llm)[:2]
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)  # system prompt + template
    assert shared >= 32
    llm.generate(first, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    computed.clear()
    llm.generate(second, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    cached = shared // 16 * 16  # whole blocks only
    assert computed[0] == {"1": len(second) - cached}  # the prompt step computed only the uncached tail
    assert engine.stats().prefix_cache_hits == cached


def test_fp8_cache_holds_a_byte_per_value_and_an_unknown_dtype_is_named():
    llms = {dtype: LLM(dtype="float32", max_model_len=256, cpu_kv_cache_gib=0.05, kv_cache_dtype=dtype)
            for dtype in ("auto", "fp8")}
    # the same budget holds four times the blocks of an fp32 cache (twice a bf16 one's)
    assert llms["fp8"].engine.kv_cache.num_blocks // 4 == llms["auto"].engine.kv_cache.num_blocks
    reply = llms["fp8"].generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8),
                                 use_tqdm=False)
    assert "Paris" in reply[0].outputs[0].text
    with pytest.raises(ValueError, match="kv_cache_dtype='int4' is not supported; use one of auto, fp8, fp8_e4m3"):
        LLM(kv_cache_dtype="int4")
