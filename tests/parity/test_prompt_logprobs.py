"""prompt_logprobs against transformers' log-softmax over the same prompt, whole and in chunks."""
import pytest
import torch

from fasterllm import LLM, SamplingParams

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest."


@pytest.mark.parametrize("budget", [None, 5], ids=["whole", "chunks-of-5"])
def test_prompt_logprobs_match_transformers(gguf, hf_smollm2, budget):
    llm = LLM(str(gguf), dtype="float32", max_model_len=256, num_kv_blocks=32, max_num_batched_tokens=budget)
    ids = llm.get_tokenizer().encode(TEXT)
    # a first run fills the prefix cache; prompt_logprobs must still score every position
    llm.generate(ids, SamplingParams(max_tokens=1), use_tqdm=False)
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    with torch.no_grad():
        reference = hf_smollm2(torch.tensor([ids])).logits[0].log_softmax(-1)
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    for position in range(1, len(ids)):
        entry = out.prompt_logprobs[position]
        actual = entry[ids[position]]
        expected = reference[position - 1]
        assert actual.logprob == pytest.approx(expected[ids[position]].item(), abs=1e-3)
        assert actual.rank == int((expected > expected[ids[position]]).sum()) + 1
        top = {lp.rank: token for token, lp in entry.items() if lp.rank <= 3 and token != ids[position]}
        for rank, token in top.items():
            assert token == expected.topk(3).indices[rank - 1].item()
    assert out.outputs[0].token_ids  # generation still happened
