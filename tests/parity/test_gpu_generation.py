"""On a GPU: SmolLM2 (the real GGUF) in bf16 through the Triton kernels and CUDA graphs.

Greedy output is checked against transformers the way vLLM checks it: identical tokens up to the
first position where the two differ, and there each side's token is among the other's top-5. A
single request replayed from CUDA graphs must give exactly the eager tokens; batches from graphs and
chunked prompts mixed with decodes (other GEMM shapes) must agree with them by the same rule.
Skipped without CUDA. FASTERLLM_TEST_GGUF names the file when the package is not installed.
"""
from __future__ import annotations

import pytest
import torch

from fasterllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("transformers")

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
             "Who wrote Hamlet?", "What is 12 times 12?", "Say hello in Spanish."]
TEXTS = ["Once upon a time", "The theory of relativity states that", "def fibonacci(n):\n    "]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def graphs_llm(gguf):
    return LLM(str(gguf), dtype="bfloat16", device="cuda", max_model_len=1024, gpu_memory_utilization=0.3)


@pytest.fixture(scope="module")
def prompts(graphs_llm):
    tok = graphs_llm.get_tokenizer()
    chats = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    return chats + [tok.encode(t) for t in TEXTS]


def near_tie_agreement(ours: list[int], ours_top: list[dict], ref: list[int], ref_top: list[list[int]]) -> bool:
    first = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    if first is None:
        return len(ours) == len(ref)
    return ref[first] in ours_top[first] and ours[first] in ref_top[first]


@pytest.fixture(scope="module")
def hf(gguf):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16).cuda().eval()


def hf_greedy(hf, prompt: list[int], eos: list[int], **processors) -> tuple[list[int], list[list[int]]]:
    """transformers' greedy tokens (through the first eos) and its top-5 ids at each step."""
    with torch.no_grad():
        g = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=NEW_TOKENS, do_sample=False,
                        eos_token_id=eos, pad_token_id=eos[0], output_scores=True, return_dict_in_generate=True,
                        **processors)
    ref = g.sequences[0, len(prompt):].tolist()
    ref = ref[:ref.index(eos[0]) + 1] if eos[0] in ref else ref
    return ref, [s[0].float().topk(5).indices.tolist() for s in g.scores]


def test_greedy_agrees_with_transformers(graphs_llm, prompts, hf):
    eos = graphs_llm.engine.tokenizer.eos_token_ids
    outputs = graphs_llm.generate([{"prompt_token_ids": p} for p in prompts],
                                  SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=5), use_tqdm=False)
    identical = 0
    for prompt, output in zip(prompts, outputs):
        ref, ref_top = hf_greedy(hf, prompt, eos)
        ours = output.outputs[0]
        assert near_tie_agreement(ours.token_ids, [list(lp) for lp in ours.logprobs], ref, ref_top), \
            (ours.token_ids, ref)
        identical += ours.token_ids == ref
    assert identical >= len(prompts) // 2  # near-ties are the exception, not the rule
    chat = graphs_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert "Paris" in chat[0].outputs[0].text


def test_graph_replay_and_chunked_batches_match_eager_single_requests(prompts, gguf):
    # no prefix caching: a cached prompt computes only its tail, another GEMM shape (bf16 near-ties)
    def engine(utilization: float, **kwargs) -> LLM:
        return LLM(str(gguf), dtype="bfloat16", device="cuda", max_model_len=1024, enable_prefix_caching=False,
                   gpu_memory_utilization=utilization, **kwargs)

    graphs_llm = engine(0.45)
    eager = engine(0.6, enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    singles = [eager.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0] for p in prompts]
    assert graphs_llm.engine.executor.runner.graphs is not None and eager.engine.executor.runner.graphs is None
    # one request: the same kernels with and without the graph, so exactly the same tokens
    replayed = [graphs_llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0] for p in prompts]
    assert [r.token_ids for r in replayed] == [s.token_ids for s in singles]
    # batches run other GEMM shapes (cuBLAS picks kernels by batch size): bf16 near-ties may flip
    batch = graphs_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    chunked = engine(0.75, max_num_batched_tokens=16)
    mixed = chunked.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for got, single in zip(batch + mixed, singles + singles):
        got = got.outputs[0]
        assert near_tie_agreement(got.token_ids, [list(lp) for lp in got.logprobs], single.token_ids,
                                  [list(lp) for lp in single.logprobs])


def test_logit_controls_on_the_gpu_agree_with_transformers(graphs_llm, prompts, hf):
    """Repetition penalty, min_tokens and bad words applied on the GPU batch, against transformers'
    processors with the same settings (the same near-tie rule; our logprobs are the raw model's, before
    the penalty, so our top-20 stands in for its top-5); the banned word never appears."""
    eos = graphs_llm.engine.tokenizer.eos_token_ids
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=20, repetition_penalty=1.3, min_tokens=8,
                            bad_words=["Paris"])
    banned = graphs_llm.engine.inputs.bad_word_ids(["Paris"])
    outputs = graphs_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        ref, ref_top = hf_greedy(hf, prompt, eos, repetition_penalty=1.3, min_new_tokens=8, bad_words_ids=banned)
        ours = output.outputs[0]
        assert near_tie_agreement(ours.token_ids, [list(lp) for lp in ours.logprobs], ref, ref_top), \
            (ours.token_ids, ref)
        assert len(ours.token_ids) >= 8 and "Paris" not in ours.text


def test_async_scheduling_agrees_with_synchronous_steps(prompts, gguf):
    """The lookahead step reads its input ids from the previous step's samples on the device and is
    replayed from the same graphs; requests of different lengths end while a lookahead is in flight.
    A step's batch can differ by the dropped rows (another GEMM shape), hence the near-tie rule."""
    def engine(async_scheduling: bool) -> LLM:  # the second may still see the first's memory: a larger share
        return LLM(str(gguf), dtype="bfloat16", device="cuda", max_model_len=1024, enable_prefix_caching=False,
                   gpu_memory_utilization=0.75 if async_scheduling else 0.5, async_scheduling=async_scheduling)

    params = [SamplingParams(temperature=0, max_tokens=8 + 5 * i, logprobs=5) for i in range(len(prompts))]
    runs = {}
    for mode in (False, True):
        llm = engine(mode)
        assert llm.engine.async_scheduling is mode
        runs[mode] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.engine.kv_cache.usage == 0
        del llm
    identical = 0
    for got, want in zip(runs[True], runs[False]):
        got, want = got.outputs[0], want.outputs[0]
        assert near_tie_agreement(got.token_ids, [list(lp) for lp in got.logprobs], want.token_ids,
                                  [list(lp) for lp in want.logprobs])
        identical += got.token_ids == want.token_ids
    assert identical >= len(prompts) - 1
