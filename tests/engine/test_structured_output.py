"""Structured output on the default SmolLM2 (fp32, CPU): JSON schemas, regexes and choices always hold, whole
batches mixing constrained and free requests, parallel samples, asynchronous scheduling and preemption; bad
constraints are errors naming the field."""
import json
import re
import threading

import pytest

from fasterllm import LLM, SamplingParams
from fasterllm.errors import InvalidInputError, StepFailedError
from fasterllm.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "home": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                                  "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                 "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "home", "active"],
    "additionalProperties": False,
}
PROMPTS = ["Describe a person as JSON.", "Invent a French student and answer in JSON.", "A retired sailor, as JSON:",
           "Give me a JSON record for a child.", "JSON for a person from Rome, please.", "Who is Ada? Answer in JSON."]


def valid(text: str) -> bool:
    """Whether text is a JSON document SCHEMA accepts (checked by hand: every keyword SCHEMA uses)."""
    doc = json.loads(text)
    home = doc["home"]
    return (set(doc) <= set(SCHEMA["properties"]) and set(SCHEMA["required"]) <= set(doc)
            and isinstance(doc["name"], str) and len(doc["name"]) <= 20
            and type(doc["age"]) is int and 0 <= doc["age"] <= 120 and type(doc["active"]) is bool
            and set(home) == {"city", "zip"} and home["city"] in ("Paris", "Rome", "Oslo")
            and re.fullmatch("[0-9]{5}", home["zip"]) is not None
            and all(isinstance(t, str) and len(t) <= 10 for t in doc.get("tags", [])) and len(doc.get("tags", [])) <= 3)


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=512, num_kv_blocks=128)


def constrained(**kwargs) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kwargs)


def test_json_schema_outputs_always_validate_greedy_and_sampled(llm):
    params = [SamplingParams(temperature=0, max_tokens=150, structured_outputs=constrained(json=SCHEMA))] + [
        SamplingParams(temperature=0.9, seed=seed, max_tokens=150, structured_outputs=constrained(json=SCHEMA))
        for seed in range(5)]
    for prompt in PROMPTS[:3]:
        for output in llm.generate([prompt] * len(params), params, use_tqdm=False):
            completion = output.outputs[0]
            assert completion.finish_reason == "stop" and valid(completion.text), completion.text


def test_regex_and_choice_always_hold(llm):
    pattern = r"(yes|no), because [a-z ]{3,30}\."
    outputs = llm.generate(PROMPTS, [SamplingParams(temperature=1.0, seed=i, max_tokens=40,
                                                    structured_outputs=constrained(regex=pattern)) for i in range(6)],
                           use_tqdm=False)
    assert all(re.fullmatch(pattern, o.outputs[0].text) for o in outputs), [o.outputs[0].text for o in outputs]
    choices = ["red", "green (dark)", "blue?"]
    outputs = llm.generate(PROMPTS, [SamplingParams(temperature=1.0, seed=i, max_tokens=10,
                                                    structured_outputs=constrained(choice=choices)) for i in range(6)],
                           use_tqdm=False)
    assert all(o.outputs[0].text in choices for o in outputs), [o.outputs[0].text for o in outputs]


def test_free_requests_in_a_constrained_batch_give_their_tokens_alone(llm):
    free = SamplingParams(temperature=0, max_tokens=24)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], free, use_tqdm=False)]
    mixed = llm.generate(PROMPTS[:3] * 2, [free] * 3 + [SamplingParams(temperature=0, max_tokens=60,
                         structured_outputs=constrained(json=SCHEMA))] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    assert all(valid(o.outputs[0].text) for o in mixed[3:] if o.outputs[0].finish_reason == "stop")


def test_parallel_samples_each_follow_their_own_grammar_state(llm):
    output = llm.generate(PROMPTS[0], SamplingParams(n=3, best_of=4, temperature=1.0, seed=3, max_tokens=150,
                                                     structured_outputs=constrained(json=SCHEMA)), use_tqdm=False)[0]
    assert len(output.outputs) == 3
    assert all(c.finish_reason == "stop" and valid(c.text) for c in output.outputs), [c.text for c in output.outputs]


def test_async_scheduling_and_preemption_give_the_same_constrained_outputs(llm):
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=100, structured_outputs=constrained(json=SCHEMA))
              for i in range(4)] + [SamplingParams(temperature=0, max_tokens=40)] * 2
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    # 6 blocks of 16 tokens for six requests of ~50 tokens each: some are preempted and recomputed
    for engine_args in ({"async_scheduling": True}, {"max_model_len": 96, "num_kv_blocks": 6}):
        other = LLM(dtype="float32", **{"max_model_len": 512, "num_kv_blocks": 128, **engine_args})
        masked_ahead = count_calls(other.engine.executor, "sample_with_masks")
        assert [o.outputs[0].text for o in other.generate(PROMPTS, params, use_tqdm=False)] == expected, engine_args
        if "num_kv_blocks" in engine_args:
            assert other.engine.stats().num_preemptions > 0
        else:  # constrained decode steps were launched before the previous step's tokens were read
            assert masked_ahead[0] > 50


def count_calls(owner, name: str) -> list[int]:
    """Counts calls of owner.name from now on (in the returned list's one item)."""
    calls, original = [0], getattr(owner, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)
    setattr(owner, name, counted)
    return calls


@pytest.mark.parametrize("kwargs, field, message", [
    ({"regex": "(unclosed"}, "structured_outputs.regex", "unclosed group"),
    ({"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}, "structured_outputs.json",
     "Invalid type: no-such-type"),
    ({"json": '{"type": "object", '}, "structured_outputs.json", "could not be compiled"),
    ({"grammar": "start: missing_rule"}, "structured_outputs.grammar", 'unknown name: "missing_rule"'),
])
def test_bad_constraints_name_their_field(llm, kwargs, field, message):
    with pytest.raises(ValueError, match=message) as error:
        llm.generate("hi", SamplingParams(structured_outputs=constrained(**kwargs)), use_tqdm=False)
    assert isinstance(error.value.__cause__, InvalidInputError) and error.value.__cause__.param == field
    assert not llm.engine.has_unfinished_requests()


def test_a_constraint_sets_exactly_one_kind():
    with pytest.raises(InvalidInputError, match="set exactly one of") as error:
        StructuredOutputsParams(regex="a", choice=["a"])
    assert error.value.param == "structured_outputs"
    with pytest.raises(InvalidInputError) as error:
        StructuredOutputsParams(choice=[])
    assert error.value.param == "structured_outputs.choice"


def test_a_hundred_sampled_requests_all_validate():
    """100 constrained requests at once, each with its own seed: every answer parses and validates against the
    nested schema (objects, an array, an enum, bounded integers, a pattern, required fields), per jsonschema. Without
    free whitespace (vLLM's disable_any_whitespace) every valid answer of this bounded schema fits well inside 200
    tokens (sampled whitespace could otherwise run a small model past any limit)."""
    jsonschema = pytest.importorskip("jsonschema")
    many = LLM(dtype="float32", max_model_len=512, num_kv_blocks=1300, max_num_seqs=128)
    compact = constrained(json=SCHEMA, disable_any_whitespace=True)
    params = [SamplingParams(temperature=0.8, seed=seed, max_tokens=200, structured_outputs=compact)
              for seed in range(100)]
    outputs = many.generate([PROMPTS[i % len(PROMPTS)] for i in range(100)], params, use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    assert len({o.outputs[0].text for o in outputs}) > 50  # sampled, not one answer a hundred times


def test_a_request_whose_grammar_is_compiling_waits_without_holding_back_the_others(llm, monkeypatch):
    """The matcher is built on a thread: while it compiles (held here until released), a free request added after
    the constrained one runs to its end; then the constrained one starts and its output holds."""
    engine = llm.engine
    release = threading.Event()
    build = type(engine.structured)._matcher
    monkeypatch.setattr(engine.structured, "_matcher", lambda grammar: release.wait(30) and build(
        engine.structured, grammar))
    regex = constrained(regex="[0-9]{3}-[0-9]{4}")
    engine.add_request("constrained", "A phone number:", SamplingParams(temperature=0, max_tokens=20,
                                                                        structured_outputs=regex))
    engine.add_request("free", "Hello", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    finished = {}
    for _ in range(50):
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0]
        if "free" in finished:
            break
    assert "free" in finished and engine.requests["constrained"].num_computed_tokens == 0  # not started yet
    release.set()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0]
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", finished["constrained"].text)


def test_a_grammar_that_fails_to_build_fails_its_request_alone(llm, monkeypatch):
    engine = llm.engine

    def fail(grammar):
        raise ValueError("the grammar could not be compiled: injected")

    monkeypatch.setattr(engine.structured, "_matcher", fail)
    engine.add_request("broken", "Hi", SamplingParams(max_tokens=5, structured_outputs=constrained(regex="[a-z]+")))
    engine.add_request("fine", "Hi", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    with pytest.raises(StepFailedError, match="injected") as failure:
        while engine.has_unfinished_requests():
            engine.step()
    assert failure.value.request_ids == ["broken"] and "broken" not in engine.requests
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert [o.request_id for o in outputs if o.finished] == ["fine"]
