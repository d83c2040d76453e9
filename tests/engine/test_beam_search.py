"""Beam search in the engine: a search's slots share full blocks and copy the last one they write, survive
preemption, batch with other requests, abort cleanly, and bad settings are refused by name."""
from __future__ import annotations

import pytest

from fasterllm import LLM, BeamSearchParams, SamplingParams

PROMPT = ("Here is a short story about a lighthouse keeper who finds a message in a bottle on the "
          "shore one winter morning:")
PARAMS = BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=256, num_kv_blocks=64, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def alone(llm):
    return [s.token_ids for s in llm.beam_search(PROMPT, PARAMS, use_tqdm=False)[0].sequences]


def run_to_end(engine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


def test_slots_share_the_prompt_blocks_and_copy_the_block_they_write(llm, alone):
    engine, kv = llm.engine, llm.engine.kv_cache
    prompt = llm.get_tokenizer().encode(PROMPT)
    full_prompt_blocks = len(prompt) // 16
    assert len(prompt) % 16 not in (0, 15)  # the last prompt block is partly full: copied, not written by two
    engine.add_request("b", prompt, PARAMS)
    engine.step()  # the prompt step: slot 0 computes it, four beams are chosen from its one row of candidates
    search = engine.requests["b"].group
    used = kv.num_blocks - kv.num_free_blocks
    assert used == full_prompt_blocks + 4  # the prompt's full blocks once; each slot's own last block
    copies = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: (lambda out: copies.append(len(out.message.copies)) or out)(schedule())
    try:
        engine.step()
    finally:
        engine.scheduler.schedule = schedule
    assert copies == [3]  # three slots copy slot 0's partly filled last block before writing; slot 0 keeps it
    tables = search.blocks.tables
    for index in range(full_prompt_blocks):
        assert len({table[index] for table in tables}) == 1  # listed by every slot
        assert kv.ref_counts[tables[0][index]] == 1  # and held once, by the search
    assert len({table[-1] for table in tables}) == 4
    output = run_to_end(engine)["b"]
    assert [c.token_ids for c in output.outputs] == alone
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert not engine.requests


def test_search_is_unchanged_beside_sampling_requests(llm, alone):
    engine = llm.engine
    engine.add_request("s1", "Once upon a time", SamplingParams(temperature=1.0, seed=1, max_tokens=20))
    engine.step()
    engine.add_request("b", PROMPT, PARAMS)
    engine.add_request("s2", "The recipe calls for", SamplingParams(n=2, temperature=0.8, seed=2, max_tokens=9))
    finished = run_to_end(engine)
    assert [c.token_ids for c in finished["b"].outputs] == alone
    assert len(finished["s2"].outputs) == 2
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_preempted_beams_recompute_and_the_search_ends_the_same(alone):
    # 11 blocks of 16 tokens: the prompt (3 blocks) and four growing beams do not all fit at once
    tight = LLM(dtype="float32", max_model_len=128, num_kv_blocks=11, enable_prefix_caching=True,
                max_num_batched_tokens=64)
    output = tight.beam_search([PROMPT, PROMPT], PARAMS, use_tqdm=False)
    assert tight.engine.stats().num_preemptions > 0
    assert [[s.token_ids for s in o.sequences] for o in output] == [alone, alone]
    assert tight.engine.kv_cache.num_free_blocks == tight.engine.kv_cache.num_blocks


def test_abort_frees_every_beam(llm):
    engine = llm.engine
    engine.add_request("b", PROMPT, PARAMS)
    for _ in range(3):
        engine.step()
    assert len({table[-1] for table in engine.requests["b"].group.blocks.tables}) == 4  # four beams hold blocks
    engine.abort_request("b")
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_n_returns_the_best_hypotheses(llm, alone):
    two = llm.beam_search(PROMPT, BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True, n=2),
                          use_tqdm=False)[0].sequences
    assert [s.token_ids for s in two] == alone[:2]


@pytest.mark.parametrize("kwargs, named", [
    ({"beam_width": 0}, "beam_width=0"),
    ({"beam_width": 2, "n": 3}, "n=3"),
    ({"beam_width": 2, "early_stopping": "sometimes"}, "early_stopping='sometimes'"),
    ({"beam_width": 2, "max_tokens": 0}, "max_tokens=0"),
    ({"beam_width": 2, "length_penalty": float("nan")}, "length_penalty=nan"),
])
def test_bad_settings_name_themselves(kwargs, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        BeamSearchParams(**kwargs)


def test_a_search_that_cannot_fit_the_pool_is_refused(llm):
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search(PROMPT, BeamSearchParams(beam_width=64, max_tokens=200), use_tqdm=False)
    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.beam_search(PROMPT, SamplingParams(), use_tqdm=False)


def test_a_failed_forward_pass_fails_the_whole_search(llm):
    from fasterllm.errors import StepFailedError

    engine = llm.engine
    engine.add_request("b", PROMPT, PARAMS)
    for _ in range(4):  # by now slots have continued other slots' beams
        engine.step()
    execute = engine.executor.runner.execute
    engine.executor.runner.execute = lambda *args: (_ for _ in ()).throw(RuntimeError("injected fault"))
    try:
        with pytest.raises(StepFailedError, match="injected fault") as failure:
            engine.step()
    finally:
        engine.executor.runner.execute = execute
    assert failure.value.request_ids == ["b"]
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
