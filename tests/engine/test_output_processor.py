import pytest

from fasterllm.engine.output_processor import IncrementalDetokenizer
from fasterllm.loader.gguf_checkpoint import GGUFFile
from fasterllm.loader.model_source import default_model_path
from fasterllm.loader.tokenizer import load_gguf_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_gguf_tokenizer(GGUFFile(default_model_path()).metadata, [2])


def stream(tokenizer, text, stop=(), include_stop=False, prompt="Say:"):
    """Feed text's tokens one by one, as generation would; return (final text, stop found, visible texts)."""
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), True, list(stop), include_stop)
    seen, found = [], None
    for token in tokenizer.encode(text):
        found = detok.add_tokens([token])
        seen.append(detok.visible_text(found is not None))
        if found:
            break
    return detok.text, found, seen


@pytest.mark.parametrize("text", ["Hello world, how are you?", " leading space and  double  spaces\nnewline",
                                  "Crème brûlée costs 5€ — 日本語のテキスト 🙂👍🏽", "digits 12345 and 3.14159"])
def test_incremental_text_equals_full_decode_and_never_shows_broken_characters(tokenizer, text):
    final, _, seen = stream(tokenizer, text)
    assert final == tokenizer.decode(tokenizer.encode(text))
    assert all("\ufffd" not in s for s in seen)
    assert all(seen[i + 1].startswith(seen[i]) for i in range(len(seen) - 1))


def test_multibyte_character_split_over_tokens_appears_whole(tokenizer):
    text = "🙂👍🏽"
    assert len(tokenizer.encode(text)) > 2  # byte-level BPE splits these into several tokens
    final, _, seen = stream(tokenizer, text)
    assert final == text and "\ufffd" not in "".join(seen)


def test_stop_string_across_token_boundaries_is_found_and_not_emitted(tokenizer):
    text = "The answer is Paris. END OF STORY and more text"
    tokens = [tokenizer.decode([t]) for t in tokenizer.encode(text)]
    assert "END OF STORY" not in tokens  # the stop string spans several tokens
    final, found, seen = stream(tokenizer, text, stop=["END OF STORY"])
    assert found == "END OF STORY"
    assert final == "The answer is Paris. "
    assert not any("END" in s for s in seen)  # streamed text never showed a piece of it


def test_include_stop_str_in_output_and_earliest_stop_wins(tokenizer):
    final, found, _ = stream(tokenizer, "one, two, three", stop=["three", "two"], include_stop=True)
    assert found == "two" and final == "one, two"


def test_partial_stop_string_is_held_back_then_released(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"), True, ["STOP"], False)
    for token in tokenizer.encode("go ST"):
        assert detok.add_tokens([token]) is None
    assert detok.visible_text(False) == "go"  # "ST" might begin "STOP"
    for token in tokenizer.encode("ART"):
        assert detok.add_tokens([token]) is None
    assert detok.text == "go START" and detok.visible_text(True) == "go START"


def test_a_kept_single_token_text_is_that_tokens_decode_under_each_special_token_rule(tokenizer):
    """The detokenizer takes a lone token's text from decode_one's store: it must be decode([id]), kept apart for
    skip_special_tokens True and False (a special token decodes to itself only when kept)."""
    special = min(tokenizer.special_ids)
    for token_id in (special, *tokenizer.encode("Crème 🙂 and")):
        for skip in (True, False, True):  # asked again: the kept text
            assert tokenizer.decode_one(token_id, skip) == tokenizer.decode([token_id], skip)
    assert tokenizer.decode_one(special, False) != tokenizer.decode_one(special, True)


def test_a_byte_level_tokenizer_is_decoded_from_its_tokens_bytes_as_the_tokenizer_decodes_it(tokenizer):
    """SmolLM2's byte-level BPE: the new tokens' bytes decoded here (no call into the tokenizer per token) give the
    same texts, step by step, as every window decoded by the tokenizer, over random tokens (partial UTF-8 pieces,
    special tokens, ids past the vocabulary) and real text, skipping special tokens or not, with stop strings."""
    import random

    assert tokenizer.decodes_bytes
    rng = random.Random(0)
    specials = sorted(tokenizer.special_ids)
    text_ids = tokenizer.encode("Crème brûlée costs 5€ — 日本語のテキスト 🙂👍🏽 and\n\n  spaces. END here")
    for trial in range(300):
        if trial % 3 == 0:
            cut = rng.randrange(1, len(text_ids))
            prompt, output = text_ids[:cut], text_ids[cut:]
        else:
            draw = lambda: rng.choice(specials) if rng.random() < 0.05 else rng.randrange(tokenizer.vocab_size + 8)
            prompt = [draw() for _ in range(rng.randrange(1, 9))]
            output = [draw() for _ in range(rng.randrange(1, 60))]
        skip, stop = trial % 2 == 0, ["END", "\n\n"] if trial % 5 == 0 else []
        fast, slow = (IncrementalDetokenizer(tokenizer, prompt, skip, stop, False) for _ in range(2))
        slow.pending = None  # every window through the tokenizer, as before the byte path
        position = 0
        while position < len(output):
            chunk = output[position:position + rng.choice([1, 1, 1, 3])]
            position += len(chunk)
            assert fast.add_tokens(chunk) == slow.add_tokens(chunk)
            assert fast.text == slow.text, (prompt, output[:position], skip)
    assert tokenizer.decodes_bytes  # no token's bytes disagreed with the tokenizer's decode of it
