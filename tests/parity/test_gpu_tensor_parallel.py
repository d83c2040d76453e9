"""On 2 or 4 GPUs: a model sharded over NCCL answers as it does on one GPU (bf16, CUDA graphs).

A random-weight Llama (peaked weights, 16 query and 4 KV heads, a vocabulary of 32,003 that does not divide) is
run greedy at tensor_parallel_size 1, 2 and (with 4 GPUs) 4. The sums of a row-parallel layer are added in
another order than one GPU adds them, so bf16 tokens are compared as test_gpu_generation compares them with
transformers: identical up to the first difference, and there each side's token among the other's top 5. Decode
steps replayed from CUDA graphs (the NCCL all-reduce captured inside) must give exactly the eager tokens.
Skipped with fewer than 2 GPUs.
"""
from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from fasterllm import LLM, SamplingParams
from parity_utils import TINY_SPECS, build_tiny_model, random_prompt
from test_gpu_generation import near_tie_agreement

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more CUDA GPUs")
pytest.importorskip("transformers")

SPEC = dataclasses.replace(TINY_SPECS[0], name="llama_gpu_tp", num_heads=16, num_kv_heads=4, head_dim=64,
                           vocab_size=32003, extra={"hidden_size": 1024, "num_hidden_layers": 8,
                                                    "intermediate_size": 2816})
PARAMS = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
PROMPTS = [random_prompt(length, SPEC.vocab_size, seed) for seed, length in enumerate((7, 30, 64, 200, 5, 90))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama_gpu_tp")
    build_tiny_model(SPEC, directory, seed=3)
    return directory


def _generate(directory, prompts=PROMPTS, **kwargs) -> list[tuple[list[int], list[dict]]]:
    llm = LLM(str(directory), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.25, **kwargs)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    finally:  # its memory back before the next engine sizes its KV cache on the same GPUs
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]


@pytest.fixture(scope="module")
def one_gpu(checkpoint):
    return _generate(checkpoint)


@pytest.mark.parametrize("size", [2, 4])
def test_sharded_greedy_agrees_with_one_gpu(checkpoint, one_gpu, size):
    if torch.cuda.device_count() < size:
        pytest.skip(f"needs {size} GPUs")
    sharded = _generate(checkpoint, tensor_parallel_size=size)
    for i, ((ours, ours_top), (ref, ref_top)) in enumerate(zip(sharded, one_gpu)):
        assert near_tie_agreement(ours, [set(t) for t in ours_top], ref, [list(t) for t in ref_top]), \
            f"prompt {i}: tp={size} {ours} vs one GPU {ref}"


MOE_BASE = next(s for s in TINY_SPECS if s.name == "qwen2_moe_shared")
MOE_SPEC = dataclasses.replace(MOE_BASE, name="qwen2_moe_gpu_tp", num_heads=16, num_kv_heads=4, head_dim=64,
                               vocab_size=32000, extra={**MOE_BASE.extra, "hidden_size": 1024, "num_hidden_layers": 4,
                                                        "num_experts": 16, "num_experts_per_tok": 4,
                                                        "moe_intermediate_size": 256,
                                                        "shared_expert_intermediate_size": 512})


def test_a_mixture_of_experts_sharded_over_2_gpus_agrees_with_one_gpu(tmp_path):
    """Every expert and the shared expert split along their intermediate size (the fused MoE kernels on each rank's
    half), the router replicated: greedy bf16 tokens as on one GPU, up to a near tie."""
    build_tiny_model(MOE_SPEC, tmp_path, seed=5)
    prompts = [random_prompt(length, MOE_SPEC.vocab_size, seed) for seed, length in enumerate((9, 40, 120))]
    one, two = (_generate(tmp_path, prompts, tensor_parallel_size=size) for size in (1, 2))
    for i, ((ours, ours_top), (ref, ref_top)) in enumerate(zip(two, one)):
        assert near_tie_agreement(ours, [set(t) for t in ours_top], ref, [list(t) for t in ref_top]), \
            f"prompt {i}: tp=2 {ours} vs one GPU {ref}"


def test_cuda_graphs_with_the_all_reduce_inside_equal_eager(checkpoint):
    """One request: its decode steps replay a graph of batch size 1, the same kernels as eager."""
    graphed = _generate(checkpoint, PROMPTS[1:2], tensor_parallel_size=2)
    eager = _generate(checkpoint, PROMPTS[1:2], tensor_parallel_size=2, enforce_eager=True)
    assert graphed[0][0] == eager[0][0]


def test_custom_all_reduce_answers_as_nccl(checkpoint):
    """The decode steps' fused symmetric-memory all-reduce + norm sums two ranks as NCCL does (one rounding), so
    tp = 2 gives the same tokens and logprobs with it as with NCCL alone."""
    fused = _generate(checkpoint, tensor_parallel_size=2)
    nccl = _generate(checkpoint, tensor_parallel_size=2, disable_custom_all_reduce=True)
    assert fused == nccl


def _fused_rank(rank: int, world: int, port: int, results) -> None:
    """One rank of test_fused_all_reduce_kernel: the kernel's rows against the ranks' rows summed (_exact_sum) + the
    fused norm, eager and replayed from a CUDA graph."""
    import torch.distributed as dist

    from fasterllm.distributed.symmetric_all_reduce import MAX_ROWS, SymmetricAllReduce
    from fasterllm.kernels.rms_norm import fused_add_rms_norm

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=device)
    hidden = 4096
    fused = SymmetricAllReduce(hidden, torch.bfloat16, device)
    weight = torch.randn(hidden, generator=torch.Generator().manual_seed(0)).to(device, torch.bfloat16)
    failures = []
    for rows in (1, 3, 17, MAX_ROWS):
        x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rank * 100 + rows)).to(device,
                                                                                                    torch.bfloat16)
        residual = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(7)).to(device, torch.bfloat16)
        expected = fused_add_rms_norm(_exact_sum(x), residual, weight, 1e-6)
        answers = _eager_and_replayed(lambda: fused.add_rms_norm(x, residual, weight, 1e-6))
        failures += _mismatches(f"{rows} rows", answers, expected)
    failures += _pushed_product_failures(fused, weight, rank)
    failures += _no_residual_failures(fused, weight, rank)
    results.put((rank, failures))
    dist.destroy_process_group()


def _exact_sum(x: torch.Tensor) -> torch.Tensor:
    """x summed over the ranks and rounded once to its dtype (their bf16 values add exactly in fp32): what the fused
    kernel gives. NCCL gives the same with two ranks; with more it rounds after each partial sum (a bf16 ulp of a
    partial sum, which a later one can cancel down to a small result), so it is not the reference."""
    import torch.distributed as dist

    gathered = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, x)
    return torch.stack(gathered).float().sum(0).to(x.dtype)


def _pushed_product_failures(fused, weight: torch.Tensor, rank: int) -> list[str]:
    """A one-row row-parallel product that pushes its row into the all-reduce's buffers itself
    (SymmetricAllReduce.product_add_rms_norm) against the product's output summed over the ranks and the fused norm,
    eager and replayed from a CUDA graph, call after call."""
    from fasterllm.kernels.rms_norm import fused_add_rms_norm
    from fasterllm.layers.gpu_linear import GPULinear

    device, hidden = weight.device, weight.shape[0]
    generator = torch.Generator().manual_seed(rank)
    linear = GPULinear(torch.randn(hidden, 1024, generator=generator).to(device, torch.bfloat16) / 32, None)
    x = torch.randn(1, 1024, generator=generator).to(device, torch.bfloat16)
    residual = torch.randn(1, hidden, generator=torch.Generator().manual_seed(7)).to(device, torch.bfloat16)
    assert fused.takes_product(linear, x)
    expected = fused_add_rms_norm(_exact_sum(linear(x)), residual, weight, 1e-6)
    answers = _eager_and_replayed(lambda: fused.product_add_rms_norm(linear, x, residual, weight, 1e-6),
                                  eager_calls=2)
    return _mismatches("pushed product", answers, expected)


def _no_residual_failures(fused, weight: torch.Tensor, rank: int) -> list[str]:
    """The first layer's norm over the embedding's partial rows (no residual yet): summed over the ranks and
    normalised, against the sum and the plain norm, eager and replayed from a CUDA graph."""
    from fasterllm.kernels.rms_norm import rms_norm

    device, hidden = weight.device, weight.shape[0]
    x = torch.randn(2, hidden, generator=torch.Generator().manual_seed(rank + 50)).to(device, torch.bfloat16)
    summed = _exact_sum(x)
    expected = (rms_norm(summed, weight, 1e-6), summed)
    return _mismatches("no residual", _eager_and_replayed(lambda: fused.add_rms_norm(x, None, weight, 1e-6)),
                       expected)


def _eager_and_replayed(call, eager_calls: int = 1) -> list[tuple[str, tuple]]:
    """("eager", call()) eager_calls times (call after call), then ("graph", call()'s output) captured in a CUDA graph
    and replayed three times."""
    answers = [("eager", call()) for _ in range(eager_calls)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        answers.append(("graph", call()))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    return answers


def _mismatches(label: str, answers: list[tuple[str, tuple]], expected: tuple) -> list[str]:
    """Each answer's (normed, residual) against expected, bit for bit; one line per mismatch."""
    failures = []
    for how, ours in answers:
        for name, got, want in zip(("normed", "residual"), ours, expected):
            if not torch.equal(got, want):
                failures.append(f"{label}, {how}, {name}: max diff {(got.float() - want.float()).abs().max().item()}")
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_fused_all_reduce_kernel_matches_the_sum_and_the_norm(world):
    """Bit-identical to the ranks' rows summed (rounded once, as NCCL's sum of two ranks is) and the fused norm."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    import torch.multiprocessing as mp

    from fasterllm.distributed.tensor_parallel import free_port

    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_fused_rank, args=(rank, world, port, results)) for rank in range(world)]
    for process in processes:
        process.start()
    answers = dict(results.get(timeout=300) for _ in processes)
    for process in processes:
        process.join(timeout=60)
    assert all(process.exitcode == 0 for process in processes)
    assert answers == {rank: [] for rank in range(world)}
