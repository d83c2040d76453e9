"""TokenizerWrapper's encodings against transformers' tokenizer on the same tokenizer.json."""
import pytest
from transformers import AutoTokenizer

from fasterllm.loader.model_source import default_embedding_model_path
from fasterllm.loader.tokenizer import load_hf_tokenizer

TEXTS = ["A man is eating food.", "The quick brown fox jumps over the lazy dog, twice!", "ok"]
# a small ChatML-style template: enough to tell the role, the turns and the generation prompt apart
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} |{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tokenizers():
    path = default_embedding_model_path()
    return load_hf_tokenizer(path, []), AutoTokenizer.from_pretrained(str(path))


def test_encode_batch_matches_one_at_a_time_and_transformers(tokenizers):
    ours, hf = tokenizers
    assert ours.encode_batch(TEXTS) == [ours.encode(t) for t in TEXTS] == hf(TEXTS)["input_ids"]


@pytest.mark.parametrize("max_tokens", [3, 6, 100])
def test_encode_last_keeps_the_end_of_the_text_inside_the_special_tokens(tokenizers, max_tokens):
    ours, hf = tokenizers
    assert ours.num_special_tokens == 2  # [CLS] and [SEP]
    text_ids = hf(TEXTS[1], add_special_tokens=False)["input_ids"]
    expected = [hf.cls_token_id] + text_ids[-(max_tokens - 2):] + [hf.sep_token_id]
    assert ours.encode_last(TEXTS[1], max_tokens) == expected


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_encode_chat_matches_transformers(tokenizers, add_generation_prompt):
    ours, hf = tokenizers
    expected = hf.apply_chat_template(CONVERSATION, chat_template=TEMPLATE, tokenize=True,
                                      add_generation_prompt=add_generation_prompt, return_dict=False)
    assert ours.encode_chat(CONVERSATION, add_generation_prompt, chat_template=TEMPLATE) == list(expected)


def test_encode_chat_without_a_template_says_how_to_fix_it(tokenizers):
    ours, _ = tokenizers
    with pytest.raises(ValueError, match="has no chat template .* pass chat_template="):
        ours.encode_chat(CONVERSATION)
