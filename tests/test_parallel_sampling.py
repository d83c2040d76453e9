"""n > 1 and best_of: the prompt is computed once, samples share its blocks copy-on-write."""
import pytest

from fasterllm import LLM, SamplingParams

PROMPT = ("Here is a short story about a lighthouse keeper who finds a message in a bottle on the "
          "shore one winter morning:")


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=256, num_kv_blocks=64, enable_prefix_caching=False)


def test_greedy_samples_all_equal_the_single_greedy_completion(llm):
    single = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    out = llm.generate(PROMPT, SamplingParams(n=3, temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == single.token_ids and c.text == single.text for c in out.outputs)


def test_prompt_is_computed_once_and_its_blocks_are_shared_then_copied_on_write(llm):
    engine = llm.engine
    prompt = llm.get_tokenizer().encode(PROMPT)
    assert len(prompt) % 16 not in (0, 15)  # the last prompt block is partly full: shared, then copied
    scheduled, copies = [], []
    schedule = engine.scheduler.schedule

    def watching_schedule():
        out = schedule()
        scheduled.append(sum(item.num_new_tokens for item in out.scheduled))
        copies.append(len(out.message.copies))
        return out

    engine.scheduler.schedule = watching_schedule
    try:
        engine.add_request("p", prompt, SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True))
        engine.step()  # the prompt step: one forward over the prompt, three samples drawn from it
        assert scheduled == [len(prompt)]
        family = engine.requests["p"].family
        tables = [engine.kv_cache.block_table(r.request_id) for r in family]
        assert len(family) == 3 and tables[0] == tables[1] == tables[2]
        assert all(engine.kv_cache.ref_counts[b] == 3 for b in tables[0])
        used = engine.kv_cache.num_blocks - engine.kv_cache.num_free_blocks
        assert used == len(tables[0])  # not three copies of the prompt
        engine.step()  # each sample writes its second token into the shared last block
        assert scheduled[1] == 3 and copies[1] == 2  # two copies; the last writer keeps the original
        tables = [engine.kv_cache.block_table(r.request_id) for r in family]
        full = len(prompt) // 16
        assert tables[0][:full] == tables[1][:full] == tables[2][:full]  # full prompt blocks still shared
        assert len({t[full] for t in tables}) == 3
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.scheduler.schedule = schedule
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_seeded_samples_are_reproducible_and_differ_from_each_other(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12)
    first = [c.token_ids for c in llm.generate(PROMPT, params, use_tqdm=False)[0].outputs]
    crowd = llm.generate(["Once upon a time", PROMPT], [SamplingParams(temperature=1.0, max_tokens=12), params],
                         use_tqdm=False)
    assert [c.token_ids for c in crowd[1].outputs] == first
    assert len({tuple(t) for t in first}) > 1


def test_best_of_keeps_the_n_most_likely_samples(llm):
    all_four = llm.generate(PROMPT, SamplingParams(n=4, best_of=4, temperature=1.0, seed=5, max_tokens=8,
                                                   logprobs=0), use_tqdm=False)[0].outputs
    best_two = llm.generate(PROMPT, SamplingParams(n=2, best_of=4, temperature=1.0, seed=5, max_tokens=8),
                            use_tqdm=False)[0].outputs
    ranked = sorted(all_four, key=lambda c: c.cumulative_logprob, reverse=True)
    assert [c.token_ids for c in best_two] == [c.token_ids for c in ranked[:2]]
    assert best_two[0].cumulative_logprob >= best_two[1].cumulative_logprob
    assert [c.index for c in best_two] == [0, 1]


def test_aborting_a_parallel_request_frees_every_sample(llm):
    engine = llm.engine
    engine.add_request("abort-me", PROMPT, SamplingParams(n=3, temperature=1.0, max_tokens=50))
    engine.step()
    engine.step()
    engine.abort_request("abort-me")
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
