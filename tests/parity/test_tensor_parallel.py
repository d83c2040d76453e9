"""Tensor parallelism on the CPU: every rank a worker process, joined over gloo (fp32).

A sharded model must answer exactly as transformers does (greedy), under continuous batching, chunked prefill,
prefix caching and preemption, with beam search, on every family's shape (GQA with fewer KV heads than ranks,
biases, tied embeddings, fused checkpoints, a vocabulary that does not divide); a rank that raises or dies must end
the engine with an error naming it, not hang it; sizes that cannot split are refused before any process starts.
"""
from __future__ import annotations

import dataclasses

import pytest

from fasterllm import LLM, SamplingParams
from fasterllm.errors import WorkerFailedError
from fasterllm.sampling_params import BeamSearchParams, StructuredOutputsParams
from fasterllm.worker import profiler
from fasterllm.worker.step_messages import SchedulerOutput
from parity_utils import (NEW_TOKENS, TINY_SPECS, build_tiny_model, first_divergence, hf_greedy, random_prompt,
                          run_staggered)
from test_generation import ARRIVAL_STEPS, GREEDY

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def smollm2_tp3(gguf):
    """SmolLM2 (9 query heads, 3 KV heads) over 3 ranks, with the tight settings of test_generation: 16-token steps,
    4 sequences at a time, 12 blocks for up to 4 requests of up to 92 tokens."""
    llm = LLM(str(gguf), dtype="float32", device="cpu", tensor_parallel_size=3, max_model_len=128, num_kv_blocks=12,
              block_size=16, max_num_batched_tokens=16, max_num_seqs=4)
    yield llm
    llm.engine.shutdown()


def test_smollm2_over_3_ranks_matches_transformers_under_batching_chunking_preemption(
        smollm2_tp3, smollm2_prompts, smollm2_reference):
    engine = smollm2_tp3.engine
    outputs = run_staggered(engine, smollm2_prompts, ARRIVAL_STEPS, GREEDY)
    assert engine.stats().num_preemptions > 0  # the tight pool preempted (by recompute) at least once
    for i, reference in enumerate(smollm2_reference):
        ours = outputs[f"staggered-{i}"]
        assert ours == reference, f"prompt {i}: {first_divergence(ours, reference)}"
    long_prompt = [{"prompt_token_ids": smollm2_prompts[1]}]
    smollm2_tp3.generate(long_prompt, GREEDY, use_tqdm=False)
    hits = engine.stats().prefix_cache_hits
    again = smollm2_tp3.generate(long_prompt, GREEDY, use_tqdm=False)
    assert engine.stats().prefix_cache_hits > hits  # its blocks were found again, on every rank
    assert list(again[0].outputs[0].token_ids) == smollm2_reference[1]


def test_smollm2_beam_search_over_3_ranks_matches_one_device(smollm2_tp3, smollm2_llm):
    params = BeamSearchParams(beam_width=3, max_tokens=12)
    prompts = ["The capital of France is", "def add(a, b):"]
    sharded = smollm2_tp3.beam_search(prompts, params, use_tqdm=False)
    single = smollm2_llm.beam_search(prompts, params, use_tqdm=False)
    for ours, reference in zip(sharded, single):
        assert [list(s.token_ids) for s in ours.sequences] == [list(s.token_ids) for s in reference.sequences]


def test_each_rank_profiles_its_own_steps(smollm2_tp3, tmp_path):
    executor = smollm2_tp3.engine.executor
    executor.collective_rpc(profiler.start)
    smollm2_tp3.generate("The capital of France is", SamplingParams(max_tokens=4), use_tqdm=False)
    ranks = executor.collective_rpc(profiler.stop, str(tmp_path))
    assert [rank["rank"] for rank in ranks] == [0, 1, 2]
    for rank in ranks:  # each worker process saw its own steps, which sum their shards' products over the group
        assert rank["seconds"] > 0 and "allreduce" in rank["table"]
        assert (tmp_path / f"rank{rank['rank']}.json").stat().st_size > 0


def test_constrained_steps_launched_ahead_over_3_ranks_match_one_device(gguf, smollm2_llm):
    """Grammar masks reach every rank after the step's forward pass was launched (asynchronous scheduling): the
    constrained and the free request answer as on one device, synchronously."""
    json_like = StructuredOutputsParams(regex=r'\{"name": "[A-Za-z ]{1,12}", "age": [0-9]{1,2}\}')
    params = [SamplingParams(temperature=0, max_tokens=30, structured_outputs=json_like),
              SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
              SamplingParams(temperature=0, max_tokens=16)]
    prompts = ["Describe a person as JSON.", "Is the sky blue?", "The capital of France is"]
    expected = [o.outputs[0].text for o in smollm2_llm.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(gguf), dtype="float32", device="cpu", tensor_parallel_size=3, max_model_len=128, num_kv_blocks=32,
              async_scheduling=True)
    try:
        executor, masked_ahead = llm.engine.executor, [0]
        sample_with_masks = executor.sample_with_masks

        def counted(masks):
            masked_ahead[0] += 1
            sample_with_masks(masks)
        executor.sample_with_masks = counted
        assert [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)] == expected
        assert masked_ahead[0] > 5
    finally:
        llm.engine.shutdown()


# mistral_mqa: 1 KV head replicated on both ranks; qwen2: q/k/v biases sharded, tied embedding; phi3: q/k/v and
# gate/up stored fused, split per rank; qwen3: q/k norms on each rank's heads; gemma2: soft-capped heads, its window
# on layer 0, four norms a layer (replicated); gemma3: one KV head on both ranks, a RoPE table per layer kind
@pytest.mark.parametrize("name", ["mistral_mqa", "qwen2_bias_tied", "phi3_fused", "qwen3_qk_norm",
                                  "gemma2_softcap_window", "gemma3_local_global"])
def test_tiny_families_over_2_ranks_match_transformers(tiny_checkpoints, name):
    directory, hf_model = tiny_checkpoints[name]
    spec = next(s for s in TINY_SPECS if s.name == name)
    _check_greedy(directory, hf_model, spec.vocab_size, tensor_parallel_size=2)


def test_vocabulary_that_does_not_divide_and_kv_heads_replicated_over_4_ranks(tmp_path):
    """387 tokens over 4 ranks (97 rows each, the last padded); 2 KV heads for 4 ranks (each on 2)."""
    spec = dataclasses.replace(TINY_SPECS[0], name="llama_odd_vocab", vocab_size=387)
    hf_model = build_tiny_model(spec, tmp_path, seed=11)
    _check_greedy(tmp_path, hf_model, spec.vocab_size, tensor_parallel_size=4)


def _check_greedy(directory, hf_model, vocab_size: int, tensor_parallel_size: int, **kwargs) -> None:
    prompts = [random_prompt(length, vocab_size, seed) for seed, length in enumerate((5, 23, 40))]
    # the 40-token prompt is prefilled in two chunks beside the others; each step launched before the last one's
    # tokens are read (asynchronous scheduling, as on a GPU)
    llm = LLM(str(directory), dtype="float32", device="cpu", tensor_parallel_size=tensor_parallel_size,
              max_num_batched_tokens=32, async_scheduling=True, **kwargs)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    for prompt, output in zip(prompts, outputs):
        reference = hf_greedy(hf_model, prompt, NEW_TOKENS)
        ours = list(output.outputs[0].token_ids)[:len(reference)]
        assert ours == reference, first_divergence(ours, reference)


@pytest.fixture
def tiny_tp2(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["llama3_gqa"][0]), dtype="float32", device="cpu", tensor_parallel_size=2)
    yield llm
    llm.engine.shutdown()


def test_a_rank_that_raises_fails_the_engine_with_its_error(tiny_tp2):
    # a step naming a request no rank has seen: every worker's runner raises KeyError
    tiny_tp2.engine.executor.execute(SchedulerOutput(request_ids=["nobody"], starts=[0], num_new_tokens=[1],
                                                     num_samples=[1], new_token_ids=[[]]))
    with pytest.raises(WorkerFailedError, match=r"rank \d of 2 failed(.|\n)*KeyError: 'nobody'"):
        tiny_tp2.generate("w5 w6 w7", SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(WorkerFailedError):  # stopped: every later call says so at once
        tiny_tp2.generate("w5 w6 w7", SamplingParams(max_tokens=4), use_tqdm=False)
    assert not tiny_tp2.engine.has_unfinished_requests()


def test_a_rank_that_dies_mid_run_fails_the_engine_naming_it(tiny_tp2):
    tiny_tp2.generate("w5 w6 w7", SamplingParams(max_tokens=2), use_tqdm=False)
    tiny_tp2.engine.executor._processes[1].kill()
    with pytest.raises(WorkerFailedError, match="rank 1 of 2 failed(.|\n)*exited with code -9"):
        tiny_tp2.generate("w5 w6 w7", SamplingParams(max_tokens=8), use_tqdm=False)


@pytest.mark.parametrize("kwargs, message", [
    ({"tensor_parallel_size": 2}, "num_attention_heads=9 does not divide over tensor_parallel_size=2"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size=0 must be >= 1"),
    ({"tensor_parallel_size": 3, "quantization": "gguf"}, "quantization='gguf' keeps the checkpoint's codes whole"),
    ({"tensor_parallel_size": 3, "distributed_executor_backend": "uni"}, "distributed_executor_backend='uni'"),
    ({"tensor_parallel_size": 3, "task": "embed"}, "task='embed' runs its encoder on one device"),
    ({"data_parallel_size": 2}, "data_parallel_size=2: an Engine is one replica.*fasterllm serve"),
    ({"data_parallel_size": 0}, "data_parallel_size=0 must be >= 1"),
])
def test_sizes_that_cannot_split_are_refused_by_name(gguf, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(gguf), device="cpu", **kwargs)


# each rank holds every expert on half its intermediate size: Mixtral (top 2 of 8, renormalized), Qwen2-MoE (its shared
# expert and sigmoid gate sharded too), Qwen3-MoE (a dense layer between expert layers)
@pytest.mark.parametrize("name", ["mixtral_moe", "qwen2_moe_shared", "qwen3_moe_dense_layer"])
def test_mixtures_of_experts_over_2_ranks_match_transformers(tiny_checkpoints, name):
    directory, hf_model = tiny_checkpoints[name]
    spec = next(s for s in TINY_SPECS if s.name == name)
    _check_greedy(directory, hf_model, spec.vocab_size, tensor_parallel_size=2)


def test_queries_normed_over_all_heads_refuse_tensor_parallelism_by_name(tiny_checkpoints):
    with pytest.raises(ValueError, match="OlmoeForCausalLM normalises its queries and keys over all heads.*"
                                         "tensor_parallel_size=1"):
        LLM(str(tiny_checkpoints["olmoe_clip"][0]), device="cpu", tensor_parallel_size=2)


def test_encoder_decoder_models_refuse_tensor_parallelism(tiny_seq2seq):
    directory = next(iter(tiny_seq2seq.values()))[0]
    with pytest.raises(ValueError, match="encoder-decoder.*tensor_parallel_size=1"):
        LLM(str(directory), device="cpu", tensor_parallel_size=2)


def test_ray_backend_on_one_machine_matches_transformers_and_fails_cleanly(tiny_checkpoints):
    """The ranks as Ray actors (a local Ray instance: no cluster runs here), over gloo, steps launched ahead; a rank
    that raises ends the engine with its error, as with worker processes."""
    ray = pytest.importorskip("ray")
    directory, hf_model = tiny_checkpoints["llama3_gqa"]
    try:
        _check_greedy(directory, hf_model, TINY_SPECS[0].vocab_size, tensor_parallel_size=2,
                      distributed_executor_backend="ray")
        llm = LLM(str(directory), dtype="float32", device="cpu", tensor_parallel_size=2,
                  distributed_executor_backend="ray")
        llm.engine.executor.execute(SchedulerOutput(request_ids=["nobody"], starts=[0], num_new_tokens=[1],
                                                    num_samples=[1], new_token_ids=[[]]))
        with pytest.raises(WorkerFailedError, match=r"rank \d of 2 failed \(Ray actor\)(.|\n)*KeyError"):
            llm.generate("w5 w6 w7", SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        ray.shutdown()


@pytest.mark.parametrize("method", ["int8", "int4", "w8a8"])
def test_quantized_linears_are_sharded_and_still_answer(gguf, method):
    """Each rank quantizes its own shard at load (a row-parallel layer's channel scales come from its columns only,
    so the numbers are near tp = 1's, not equal): the answer must survive."""
    llm = LLM(str(gguf), dtype="float32", device="cpu", tensor_parallel_size=3, quantization=method,
              max_model_len=256)
    try:
        chat = llm.get_tokenizer().encode_chat([{"role": "user", "content": "What is the capital of France?"}])
        answer = llm.generate([{"prompt_token_ids": chat}], SamplingParams(temperature=0, max_tokens=24),
                              use_tqdm=False)[0].outputs[0].text
    finally:
        llm.engine.shutdown()
    assert "Paris" in answer, answer
