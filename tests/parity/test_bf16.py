"""bf16 (the CPU default where the CPU has native bf16) against transformers in bf16, the way vLLM checks it:
identical greedy tokens up to the first disagreement, and there each side's token is in the other's top 5."""
import copy

import pytest
import torch

from fasterllm import LLM, SamplingParams

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def llm_bf16(gguf):
    return LLM(str(gguf), dtype="bfloat16", device="cpu", max_model_len=512, num_kv_blocks=64)


@pytest.fixture(scope="module")
def hf_bf16(hf_smollm2):
    return copy.deepcopy(hf_smollm2).to(torch.bfloat16)


def test_bf16_greedy_agrees_with_transformers_up_to_near_ties(llm_bf16, hf_bf16):
    tokenizer = llm_bf16.get_tokenizer()
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    ours = llm_bf16.chat(conversations, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=5),
                         use_tqdm=False)
    for conversation, output in zip(conversations, ours):
        prompt = tokenizer.encode_chat(conversation)
        with torch.no_grad():
            ref = hf_bf16.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                   output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        ref_tokens = ref.sequences[0, len(prompt):].tolist()
        ours_tokens = output.outputs[0].token_ids
        for i, (a, b) in enumerate(zip(ours_tokens, ref_tokens)):
            if a != b:
                ref_top5 = ref.scores[i][0].topk(5).indices.tolist()
                assert a in ref_top5 and b in output.outputs[0].logprobs[i], (
                    f"{conversation[0]['content']!r}: token {i} differs ({a} vs {b}) and is not a near-tie")
                break
    assert "Paris" in ours[0].outputs[0].text
