"""Asynchronous scheduling: the next decode step launched before this step's tokens are read.

The engine with it must return exactly what the synchronous engine returns (tokens, texts, finish
reasons, logprobs, seeded samples), also when requests arrive, stop on a string or eos, hit their
token limit, are aborted, or need their tokens on the host (penalties) while a lookahead step is in
flight; and every block comes back. Runs on the CPU, where async_scheduling=True takes the same path
(the forward pass is merely synchronous there).
"""
import pytest

from fasterllm import LLM, SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "List three colours:",
           "The quick brown fox", "In 1969, the first"]


@pytest.fixture(scope="module")
def engines():
    def make(async_scheduling: bool) -> LLM:
        return LLM(None, dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=64, block_size=16,
                   async_scheduling=async_scheduling)
    return make(False), make(True)


def lookahead_count(monkeypatch, llm) -> list[int]:
    """Counts the lookahead steps the engine launched (to show the path under test really ran)."""
    launched = [0]
    scheduler = llm.engine.scheduler
    original = scheduler.schedule_lookahead

    def spy(in_flight, sampled_ids):
        out = original(in_flight, sampled_ids)
        launched[0] += out is not None
        return out
    monkeypatch.setattr(scheduler, "schedule_lookahead", spy)
    return launched


def summary(outputs):
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
             [sorted(lp.items()) for lp in o.outputs[0].logprobs or []]) for o in outputs]


def test_same_outputs_as_synchronous(engines, monkeypatch):
    sync, lookahead = engines
    params = [SamplingParams(temperature=0, max_tokens=12, logprobs=2),
              SamplingParams(temperature=0, max_tokens=1),
              SamplingParams(temperature=0.8, seed=7, max_tokens=10),
              SamplingParams(temperature=0, max_tokens=30, stop=[","]),
              SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3),  # reads tokens on the host
              SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=16)]
    launched = lookahead_count(monkeypatch, lookahead)
    expected = sync.generate(PROMPTS, params, use_tqdm=False)
    got = lookahead.generate(PROMPTS, params, use_tqdm=False)
    assert summary(got) == summary(expected)
    assert launched[0] > 0
    assert lookahead.engine.kv_cache.usage == 0  # the dropped lookahead rows' blocks came back


def test_staggered_arrivals_and_an_abort_in_flight(engines):
    sync, lookahead = engines
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ids = [lookahead.get_tokenizer().encode(p) for p in PROMPTS[:3]]

    def run(llm, abort_at: int | None) -> dict[str, list[int]]:
        engine, finished = llm.engine, {}
        for step in range(200):
            if step < 3:  # a new request before each of the first steps
                engine.add_request(f"r{step}", ids[step], params)
            if step == abort_at:
                engine.abort_request("r1")
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output.outputs[0].token_ids
            if step > 3 and not engine.has_unfinished_requests():
                break
        return finished

    expected = run(sync, None)
    assert run(lookahead, None) == expected
    aborted = run(lookahead, abort_at=5)
    assert "r1" not in aborted and aborted == {k: v for k, v in expected.items() if k != "r1"}
    lookahead.engine.step()  # the last launched step, if any, is drained
    assert lookahead.engine.kv_cache.usage == 0


def test_a_reused_request_id_never_gets_a_dropped_lookahead_token(engines):
    """A request ends while its lookahead row is in flight; the same id is added again at once: the new
    request's tokens are its own (as the synchronous engine gives them), not the dropped row's."""
    sync, lookahead = engines
    ids = lookahead.get_tokenizer().encode(PROMPTS[1])
    first, second = SamplingParams(temperature=0, max_tokens=3), SamplingParams(temperature=0, max_tokens=4)

    def run(llm) -> list[int]:
        engine = llm.engine
        engine.add_request("same", ids, first)
        while engine.has_unfinished_requests():
            engine.step()
        engine.add_request("same", ids[:3], second)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        return [o.outputs[0].token_ids for o in outputs if o.finished]

    assert run(lookahead) == run(sync)


def test_a_failed_lookahead_fails_neither_an_aborted_request_nor_a_new_one_of_its_id(engines, monkeypatch):
    """A lookahead step whose grammar masks could not be applied fails its requests at the next step. If its one
    request was aborted meanwhile and its id added again, the new request runs on untouched."""
    _, lookahead = engines
    engine = lookahead.engine
    ids = lookahead.get_tokenizer().encode(PROMPTS[0])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("same", ids, params)
    engine.step()  # the prompt; its lookahead (the first decode) is in flight
    assert engine._in_flight is not None
    failed_batch, engine._in_flight = engine._in_flight[0], None
    engine._failed_lookahead = (failed_batch, RuntimeError("masks could not be applied"))
    engine.abort_request("same")
    engine.add_request("same", ids, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.outputs[0].finish_reason for o in outputs if o.finished] == ["length"]
    engine.step()
    assert engine.kv_cache.usage == 0


def test_prompt_chunks_and_admissions_go_on_while_a_step_is_in_flight(monkeypatch):
    """Long prompts in chunks of 8 and more requests than max_num_seqs: lookahead steps carry the next chunk of a
    prompt whose chunk is in flight and admit waiting requests, and every output is the synchronous engine's."""
    def make(async_scheduling: bool) -> LLM:
        return LLM(None, dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=64, block_size=16,
                   async_scheduling=async_scheduling, long_prefill_token_threshold=8, max_num_seqs=3)
    sync, lookahead = make(False), make(True)
    chunked = []  # lookahead steps holding a prompt chunk (not only decodes)
    scheduler = lookahead.engine.scheduler
    original = scheduler.schedule_lookahead

    def spy(in_flight, sampled_ids):
        out = original(in_flight, sampled_ids)
        if out is not None and any(not item.lookahead for item in out.scheduled):
            chunked.append(out)
        return out
    monkeypatch.setattr(scheduler, "schedule_lookahead", spy)
    prompts = [p + " and then, as everyone expected, the story went on" for p in PROMPTS]
    params = [SamplingParams(temperature=0, max_tokens=6 + i) for i in range(len(prompts))]
    assert summary(lookahead.generate(prompts, params, use_tqdm=False)) == summary(
        sync.generate(prompts, params, use_tqdm=False))
    assert chunked
    assert lookahead.engine.kv_cache.usage == 0


def test_the_prefill_cap_beside_decodes_changes_no_output(engines):
    """Requests arriving while others decode, with their prompts' share of such steps capped at 4 tokens (in
    lookahead steps too): every output is the uncapped engine's (tokens, text; the
    logprobs of prompts computed in other chunks to fp32 rounding), no step carrying a decode gives prompts more than
    4 tokens, and every block comes back."""
    sync, _ = engines
    capped = LLM(None, dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=64, block_size=16,
                 async_scheduling=True, max_prefill_tokens_beside_decodes=4)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1)

    def staggered(llm: LLM) -> tuple[list, list[tuple[bool, int]]]:
        engine, outputs, steps = llm.engine, [], []
        original = engine.scheduler._with_message

        def spy(out):  # (a lookahead step?, its prompt tokens) of each step that carries a decode
            decodes = [item.lookahead or item.start >= item.request.num_tokens - 1 for item in out.scheduled]
            if any(decodes):
                steps.append((any(item.lookahead for item in out.scheduled),
                              sum(item.num_new_tokens for item, d in zip(out.scheduled, decodes) if not d)))
            return original(out)
        engine.scheduler._with_message = spy
        try:
            for i, prompt in enumerate(PROMPTS):
                engine.add_request(str(i), prompt, params)
                outputs += engine.step()
            while engine.has_unfinished_requests():
                outputs += engine.step()
        finally:
            del engine.scheduler._with_message
        return sorted((o for o in outputs if o.finished), key=lambda o: int(o.request_id)), steps

    expected, uncapped = staggered(sync)
    got, capped_steps = staggered(capped)
    assert [(o.outputs[0].token_ids, o.outputs[0].text) for o in got] == [
        (o.outputs[0].token_ids, o.outputs[0].text) for o in expected]
    for output, reference in zip(got, expected):
        for step, reference_step in zip(output.outputs[0].logprobs, reference.outputs[0].logprobs):
            assert step.keys() == reference_step.keys()
            assert all(abs(step[t].logprob - reference_step[t].logprob) < 1e-4 for t in step)
    assert max(tokens for _, tokens in uncapped) > 4
    assert 0 < max(tokens for _, tokens in capped_steps) <= 4
    assert any(lookahead and tokens for lookahead, tokens in capped_steps)  # lookahead steps were capped too
    assert capped.engine.kv_cache.usage == 0
