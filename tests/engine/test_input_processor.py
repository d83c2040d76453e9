"""Every prompt check in one place, without a model: each refusal names its field (InvalidInputError.param) and
says the limit; the server reports that field."""
import pytest

from fasterllm import SamplingParams
from fasterllm.engine.input_processor import InputProcessor, as_prompt_list, prompt_value
from fasterllm.errors import InvalidInputError

VOCAB, MAX_LEN = 100, 8


class WordTokenizer:
    """'w5 w7' -> [5, 7]: enough of a tokenizer for the checks."""

    num_special_tokens = 0

    def encode(self, text, add_special_tokens=True):
        return [int(word[1:]) for word in text.split()]

    def encode_batch(self, texts):
        return [self.encode(t) for t in texts]

    def encode_last(self, text, keep):
        return self.encode(text)[-keep:]


@pytest.fixture
def inputs():
    return InputProcessor(WordTokenizer(), VOCAB, MAX_LEN)


def refused(call, *args, **kwargs) -> InvalidInputError:
    with pytest.raises(InvalidInputError) as info:
        call(*args, **kwargs)
    assert isinstance(info.value, ValueError)  # callers that catch ValueError still do
    return info.value


def test_a_generation_prompt_becomes_token_ids_or_a_named_refusal(inputs):
    assert inputs.generation_prompt("w3 w4") == ("w3 w4", [3, 4])
    assert inputs.generation_prompt([5, 6]) == (None, [5, 6])
    assert refused(inputs.generation_prompt, "").param == "prompt"
    error = refused(inputs.generation_prompt, [5, 100, True])
    assert error.param == "prompt" and "[100, True] are not valid: ids must be integers in [0, 100)" in str(error)
    error = refused(inputs.generation_prompt, list(range(MAX_LEN)))
    assert error.param == "prompt" and "has 8 tokens but max_model_len is 8" in str(error)


def test_the_servers_length_rule_names_the_field_it_was_given(inputs):
    inputs.check_generation_length(3, 5, "prompt", "max_tokens")
    error = refused(inputs.check_generation_length, 3, 6, "messages", "max_completion_tokens")
    assert error.param == "max_completion_tokens" and "can be at most 5" in str(error)
    assert refused(inputs.check_generation_length, 8, None, "messages", "max_tokens").param == "messages"


def test_completion_prompts_are_named_by_index(inputs):
    assert inputs.generation_prompts("w1 w2") == [[1, 2]]
    assert inputs.generation_prompts([[1], "w2"]) == [[1], [2]]
    assert "prompt is an empty list" in str(refused(inputs.generation_prompts, []))
    assert "prompt 1 is empty" in str(refused(inputs.generation_prompts, ["w1", ""]))


def test_token_ids_in_parameters_must_be_in_the_vocabulary(inputs):
    inputs.check_sampling_token_ids(SamplingParams(stop_token_ids=[99], logit_bias={5: 1.0}))
    for field, params in (("stop_token_ids", SamplingParams(stop_token_ids=[100])),
                          ("allowed_token_ids", SamplingParams(allowed_token_ids=[1, 200])),
                          ("logit_bias", SamplingParams(logit_bias={100: 1.0}))):
        error = refused(inputs.check_sampling_token_ids, params)
        assert error.param == field and "outside the vocabulary [0, 100)" in str(error)


def test_sampling_params_name_their_field():
    assert refused(SamplingParams, temperature=-1).param == "temperature"
    assert refused(SamplingParams, logit_bias={5: 500}).param == "logit_bias"
    assert refused(SamplingParams, max_tokens=2, min_tokens=3).param == "min_tokens"


def test_embedding_inputs_truncate_or_name_the_input_at_fault(inputs):
    assert inputs.embedding_inputs(["w1 w2", [3, 4]]) == [[1, 2], [3, 4]]
    assert inputs.embedding_inputs([list(range(20))], truncate_prompt_tokens=-1) == [list(range(12, 20))]
    error = refused(inputs.embedding_inputs, ["w1", list(range(9))])
    assert error.param == "input" and str(error).startswith("input 1: the input has 9 tokens")
    assert refused(inputs.embedding_inputs, ["w1"], truncate_prompt_tokens=9).param == "truncate_prompt_tokens"


def test_offline_prompt_shapes():
    assert as_prompt_list("hi") == ["hi"] and as_prompt_list([1, 2]) == [[1, 2]]
    assert prompt_value({"prompt_token_ids": (1, 2)}) == [1, 2]
    assert refused(as_prompt_list, []).param == "prompts"
    assert refused(prompt_value, 3.5).param == "prompt"
