"""Where a GPU run stands against the device's own limits, measured in the same process.

Decode at small batch is bound by memory: each step reads every weight once, so weight bytes / step
time is the bandwidth achieved, next to a device-to-device copy's. Large batches are bound by
matrix math: 2 x parameters x tokens / time against a large bf16 matmul's rate is the model FLOPs
utilisation (MFU). A mixture of experts counts, for both, the top_k experts a token is routed to.
"""
from __future__ import annotations

import torch

from fasterllm.engine.engine import Engine
from fasterllm.layers.moe import SparseMoE


def time_cuda(fn, repeats: int) -> float:
    """Median seconds of fn() over repeats, timed with CUDA events after a warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device, gib: float = 0.5) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    source = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    seconds = time_cuda(lambda: target.copy_(source), 10)
    return 2 * source.numel() / seconds


def matmul_peak(device: torch.device, dtype: torch.dtype, size: int = 8192) -> float:
    """FLOP/s of a size^3 matmul in dtype: the practical peak MFU is measured against."""
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    seconds = time_cuda(lambda: a @ b, 20)
    return 2 * size**3 / seconds


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of weights one batch-1 decode step reads: every tensor the modules hold (a quantized layer's codes and
    scales too, which are not Parameters), less the input embedding table unless the output head reads it (a
    separate head: a step reads one row of the table); of a mixture of experts' stacked experts, the top_k a token
    is routed to."""
    sizes: dict[int, int] = {}
    for module in model.modules():
        held = [*module._parameters.values(), *module._buffers.values(),
                *(v for v in vars(module).values() if isinstance(v, torch.Tensor))]
        experts = {id(module.w_gate_up), id(module.w_down)} if isinstance(module, SparseMoE) else set()
        for tensor in held:
            if tensor is not None:  # keyed by storage: a tied table counts once (oneDNN-packed CPU tensors have none)
                key = tensor.data_ptr() if not tensor.is_mkldnn else id(tensor)
                sizes[key] = tensor.numel() * tensor.element_size()
                if id(tensor) in experts:
                    sizes[key] = sizes[key] * module.top_k // tensor.shape[0]
    head = getattr(model, "lm_head", None)
    table = model.embed_tokens.weight
    if head is not None and getattr(head, "weight", None) is not table:
        sizes.pop(table.data_ptr(), None)
    return sum(sizes.values())


def active_parameters(model: torch.nn.Module) -> int:
    """Parameters one token is multiplied by: all of them, but of a mixture of experts' stacked experts only the
    top_k it is routed to (what MFU counts)."""
    total = sum(p.numel() for p in model.parameters())
    for moe in (m for m in model.modules() if isinstance(m, SparseMoE)):
        experts = moe.w_gate_up.numel() + moe.w_down.numel()
        total -= experts - experts * moe.top_k // moe.w_gate_up.shape[0]
    return total


def rank_weights(runner) -> tuple[int, int, int]:
    """(parameters, active parameters, weight bytes a decode step reads) of one rank's model (run on each rank by the
    executor)."""
    model = runner.model
    return sum(p.numel() for p in model.parameters()), active_parameters(model), weight_bytes_per_step(model)


def print_roofline(engine: Engine, run: dict[str, float], tokens_processed: int) -> dict[str, float]:
    """With tensor parallelism: the weights and bandwidth of one GPU (the rank reading most), the MFU of all."""
    ranks = engine.executor.collective_rpc(rank_weights)
    parameters, active = (sum(rank[i] for rank in ranks) for i in (0, 1))
    weight_bytes = max(size for *_, size in ranks)
    bandwidth = copy_bandwidth(engine.device)
    peak = matmul_peak(engine.device, engine.dtype)
    achieved = weight_bytes / (run["tpot_median_ms"] / 1e3)
    mfu = 2 * active * tokens_processed / run["seconds"] / (peak * len(ranks))
    per_gpu = f" on each of {len(ranks)} GPUs" if len(ranks) > 1 else ""
    print(f"device        : {torch.cuda.get_device_name(engine.device)}; weights {weight_bytes / 1e9:.2f} GB{per_gpu} "
          f"({parameters / 1e9:.2f} B parameters{f', {active / 1e9:.2f} B active' if active < parameters else ''}); copy bandwidth {bandwidth / 1e12:.2f} TB/s; "
          f"{str(engine.dtype).removeprefix('torch.')} matmul {peak / 1e12:.0f} TFLOP/s")
    print(f"roofline      : decode step reads weights at {achieved / 1e12:.2f} TB/s{per_gpu} = {achieved / bandwidth:.0%} "
          f"of copy bandwidth; MFU {mfu:.1%} ({tokens_processed} tokens in {run['seconds']:.2f} s)")
    print("start-up      : " + ", ".join(f"{k} {v:.1f}s" for k, v in engine.startup_seconds.items()))
    return {"weight_bytes": weight_bytes, "copy_bandwidth": bandwidth, "matmul_peak": peak,
            "achieved_bandwidth": achieved, "mfu": mfu}
