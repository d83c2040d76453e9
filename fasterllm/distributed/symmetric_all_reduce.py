"""The all-reduce that ends a row-parallel layer, fused with the residual add and RMSNorm after it, for a few token
rows on GPUs that reach each other's memory (NVLink): kernels/one_shot_all_reduce.py over buffers in torch's
symmetric memory. Larger batches (prefill chunks), and setups without symmetric memory, keep NCCL and the separate
norm: TensorParallel.all_reduce_add_norm and row_parallel_add_norm choose, the same way on every rank."""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger("fasterllm")

MAX_ROWS = 64  # decode batches up to this many rows; above, NCCL's bandwidth-bound ring is as fast


class SymmetricAllReduce:
    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        from fasterllm.kernels.one_shot_all_reduce import COPIES, EMPTY, RankBuffers

        if dtype.itemsize != 2:
            raise ValueError(f"the fused all-reduce takes 16-bit models (bf16, fp16), not {dtype}")
        self.hidden_size, self.dtype = hidden_size, dtype
        world = dist.get_world_size()
        self._buffer = symm_mem.empty(COPIES * world * MAX_ROWS * hidden_size, dtype=torch.int16, device=device)
        self._buffer.fill_(EMPTY)
        handle = symm_mem.rendezvous(self._buffer, dist.group.WORLD)
        # every rank's buffer, and each row slot's calls so far
        self.target = RankBuffers(torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device),
                                  torch.zeros(MAX_ROWS, dtype=torch.int32, device=device), dist.get_rank(), world)
        self._handle = handle  # keeps the peers' mappings alive as long as this object
        torch.cuda.synchronize(device)
        dist.barrier()  # every rank's slots are empty before any rank writes one

    def fits(self, x: torch.Tensor) -> bool:
        return (x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.shape[1] == self.hidden_size and x.dtype == self.dtype
                and x.is_contiguous())

    def takes_product(self, linear: torch.nn.Module, x: torch.Tensor) -> bool:
        """Whether linear(x) can push its row straight into the buffers: one row through our matrix-vector kernel
        (GPULinear), as wide as the rows this all-reduce sums."""
        from fasterllm.layers.gpu_linear import GPULinear

        return (type(linear) is GPULinear and linear.padded_weight is None and isinstance(x, torch.Tensor)
                and x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous() and x.dtype == self.dtype
                and linear.out_features == self.hidden_size)

    def product_add_rms_norm(self, linear: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor,
                             weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """add_rms_norm(linear(x), ...) where takes_product(linear, x): the product's kernel writes this rank's
        row into every rank's buffer on its way out, and the all-reduce launch only waits, sums and normalises."""
        from fasterllm.kernels.one_shot_all_reduce import all_reduce_add_rms_norm

        linear.push_row(x, self.target)
        return all_reduce_add_rms_norm(None, residual.contiguous(), weight, eps, self.target)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        from fasterllm.kernels.one_shot_all_reduce import all_reduce_add_rms_norm

        return all_reduce_add_rms_norm(x, None if residual is None else residual.contiguous(), weight, eps,
                                       self.target)


def try_symmetric_all_reduce(hidden_size: int, dtype: torch.dtype, device: torch.device
                             ) -> SymmetricAllReduce | None:
    """The fused path where this machine's GPUs and torch allow it, else None (NCCL then), said once in the log."""
    try:
        fused = SymmetricAllReduce(hidden_size, dtype, device)
    except Exception as exc:  # no peer access, no symmetric memory in this torch build: NCCL does it all
        logger.warning("symmetric-memory all-reduce unavailable (%s); the all-reduces go through NCCL", exc)
        fused = None
    everywhere = torch.tensor([fused is not None], dtype=torch.int32, device=device)
    dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)  # every rank takes the same path, or the kernels wait forever
    return fused if everywhere.item() else None
