"""Prefix caching, chunked prefill and preemption never change what a request generates (fp32, greedy)."""
import pytest

from fasterllm import LLM, SamplingParams

SYSTEM = ("You are a careful assistant. Answer briefly and precisely, and say so when you do not know. "
          "Prefer plain words over jargon.")
QUESTIONS = ["What is the capital of France?", "Name a prime number.", "Why is the sky blue?",
             "What is two plus two?"]
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def prompts(llm):
    tokenizer = llm.get_tokenizer()
    return [tokenizer.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
            for q in QUESTIONS]


def generate_twice(max_model_len=256, **engine_args):
    """Two rounds of the same prompts: the second can hit the prefix cache the first filled."""
    llm = LLM(dtype="float32", max_model_len=max_model_len, **engine_args)
    batch = prompts(llm)
    rounds = [[o.outputs[0].token_ids for o in llm.generate(batch, PARAMS, use_tqdm=False)] for _ in range(2)]
    return rounds, llm.engine.stats()


@pytest.fixture(scope="module")
def reference():
    rounds, stats = generate_twice(enable_prefix_caching=False, num_kv_blocks=200)
    assert rounds[0] == rounds[1] and stats.prefix_cache_hits == 0 and stats.num_preemptions == 0
    return rounds[0]


def test_prefix_caching_gives_identical_tokens_and_hits(reference):
    rounds, stats = generate_twice(enable_prefix_caching=True, num_kv_blocks=200)
    assert rounds == [reference, reference]
    # the second round finds every full block of every prompt (about 47 tokens: 2 blocks of 16)
    assert stats.prefix_cache_hits >= len(QUESTIONS) * 2 * 16


@pytest.mark.parametrize("budget", [3, 16])  # 3: chunks end inside blocks, decodes wait for budget
def test_chunk_sizes_give_identical_tokens(reference, budget):
    rounds, _ = generate_twice(max_num_batched_tokens=budget, num_kv_blocks=200)
    assert rounds == [reference, reference]


@pytest.mark.parametrize("caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_identical_tokens(reference, mode, caching):
    # 10 blocks of 16 tokens: three ~47-token prompts are admitted (3 blocks each), then each needs a
    # fourth block for its answer, and only one is left
    rounds, stats = generate_twice(max_model_len=96, num_kv_blocks=10, preemption_mode=mode, swap_space_gib=0.05,
                                   enable_prefix_caching=caching)
    assert rounds == [reference, reference]
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_swapped_out > 0 and stats.num_swapped_in == stats.num_swapped_out
    assert stats.kv_cache_usage == 0.0  # everything freed at the end


def test_long_prefill_cap_gives_identical_tokens(reference):
    rounds, _ = generate_twice(long_prefill_token_threshold=8, num_kv_blocks=200)
    assert rounds == [reference, reference]


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
