"""Every stop rule in one place: eos (not detokenized), stop token ids, the token limit, stop strings, and which
wins when one token meets two; with the SmolLM2 tokenizer, no model."""
import pytest

from fasterllm.engine.output_processor import OutputProcessor
from fasterllm.engine.request import Request
from fasterllm.engine.stop_checker import check_stop
from fasterllm.loader.gguf_checkpoint import GGUFFile
from fasterllm.loader.model_source import default_model_path
from fasterllm.loader.tokenizer import load_gguf_tokenizer
from fasterllm.sampling_params import SamplingParams

EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    return load_gguf_tokenizer(GGUFFile(default_model_path()).metadata, [EOS])


def generate(tokenizer, text: str, **params):
    """Append text's tokens one at a time as the engine does; returns (stop found, text shown, tokens taken)."""
    request = Request("r", None, tokenizer.encode("Say:"), SamplingParams(**params), [EOS], 1024)
    processor = OutputProcessor(tokenizer)
    processor.add_request(request)
    for token in tokenizer.encode(text) + [EOS]:
        request.append_token(token)
        stop = check_stop(request, processor)
        if stop is not None:
            request.finish(*stop)
            break
    return stop, processor.make_output(request).outputs[0].text, len(request.output_token_ids)


def test_eos_stops_and_is_not_detokenized(tokenizer):
    shown = generate(tokenizer, "Hello there", skip_special_tokens=False)  # eos would show as text
    assert shown == (("stop", None), "Hello there", len(tokenizer.encode("Hello there")) + 1)
    stop, text, _ = generate(tokenizer, "Hello there", ignore_eos=True, max_tokens=50, skip_special_tokens=False)
    assert stop is None and text == "Hello there" + tokenizer.decode([EOS], skip_special_tokens=False)


def test_stop_token_id_and_the_token_limit(tokenizer):
    ids = tokenizer.encode("one two three four")
    assert generate(tokenizer, "one two three four", stop_token_ids=[ids[2]])[0] == ("stop", ids[2])
    stop, text, taken = generate(tokenizer, "one two three four", max_tokens=2)
    assert (stop, taken) == (("length", None), 2) and text == tokenizer.decode(ids[:2])


def test_a_stop_string_ends_the_text_before_it(tokenizer):
    stop, text, _ = generate(tokenizer, "one two, three four", stop=[","])
    assert stop == ("stop", ",") and text == "one two"


def test_a_token_rule_wins_over_a_stop_string_met_by_the_same_token(tokenizer):
    ids = tokenizer.encode("one two, three")
    comma = next(i for i, t in enumerate(ids) if "," in tokenizer.decode([t])) + 1
    stop, text, _ = generate(tokenizer, "one two, three", stop=[","], max_tokens=comma)
    assert stop == ("length", None) and text == "one two"
