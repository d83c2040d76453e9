"""Tensor parallelism (Megatron-style): this rank's place in the group, its share of heads and rows, and the two
collectives a sharded layer needs (torch.distributed: NCCL on GPUs, gloo on CPUs).

A model takes a TensorParallel and builds only its rank's part: column-parallel projections (Q/K/V, gate/up) keep
rows of the output, row-parallel ones (o_proj, down_proj) columns of the input and sum over ranks with one
all-reduce, the embedding and the output head keep rows of the vocabulary. With size 1 every collective is
skipped: one device runs exactly as without tensor parallelism.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from fasterllm.config import STORED_METHODS
from fasterllm.distributed.symmetric_all_reduce import SymmetricAllReduce
from fasterllm.layers.norm import RMSNorm

# how long a collective may wait for the other ranks before it fails instead of hanging (gloo raises; NCCL's
# watchdog ends the process, which the executor sees)
COLLECTIVE_TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    # on GPUs with symmetric memory: a decode step's all-reduces fused with the norm after them
    symmetric: SymmetricAllReduce | None = field(default=None, compare=False, repr=False)

    def shard(self, total: int, what: str) -> int:
        """This rank's share of `total` (heads, rows): total / size, which must be whole."""
        if total % self.size:
            raise ValueError(f"{what}={total} does not divide over tensor_parallel_size={self.size}; use a "
                             f"tensor_parallel_size that divides {total}")
        return total // self.size

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first KV head, KV heads) this rank keeps: a share of them, or, with fewer KV heads than ranks, one
        head replicated over size / num_kv_heads ranks (the query heads that read it sit on those ranks)."""
        if num_kv_heads >= self.size:
            local = self.shard(num_kv_heads, "num_key_value_heads")
            return self.rank * local, local
        if self.size % num_kv_heads:
            raise ValueError(f"num_key_value_heads={num_kv_heads} is fewer than tensor_parallel_size={self.size} "
                             f"and does not divide it, so its heads cannot be replicated evenly; use a "
                             f"tensor_parallel_size that {num_kv_heads} divides")
        return self.rank * num_kv_heads // self.size, 1

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """(first row, rows per rank) of the vocabulary: ceil(vocab / size) each, the last rank's padded."""
        per_rank = -(-vocab_size // self.size)
        return self.rank * per_rank, per_rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (a row-parallel layer's partial products)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_reduce_add_norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(sum over ranks of x, residual): a row-parallel layer's partial sums (or the embedding's, with no
        residual yet), summed, added to the residual stream and normalised; one fused launch where the
        symmetric-memory path takes these rows, else the all-reduce, then the norm."""
        if self.size > 1:
            if self.symmetric is not None and type(norm) is RMSNorm and self.symmetric.fits(x):
                return self.symmetric.add_rms_norm(x, residual, norm.weight, norm.eps)
            dist.all_reduce(x)
        return norm(x, residual)

    def row_parallel_add_norm(self, linear: nn.Module | None, x: torch.Tensor, residual: torch.Tensor,
                              norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """all_reduce_add_norm(linear(x), residual, norm) for a row-parallel linear (None: x as it is). Where the
        fused path takes a one-row product, the product's kernel writes its row into every rank's buffer itself,
        so the row travels while the product finishes and the all-reduce's launch only waits, sums and
        normalises."""
        if linear is None:
            return self.all_reduce_add_norm(x, residual, norm)
        if (self.size > 1 and self.symmetric is not None and type(norm) is RMSNorm
                and self.symmetric.takes_product(linear, x)):
            return self.symmetric.product_add_rms_norm(linear, x, residual, norm.weight, norm.eps)
        return self.all_reduce_add_norm(linear(x), residual, norm)

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank order (the vocabulary shards of the logits), on every
        rank: each samples the same tokens from the same logits, so every rank holds them for the next step."""
        if self.size == 1:
            return x
        gathered = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_single(gathered, x.contiguous())  # rank after rank along dim 0
        return gathered.view(self.size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])


SINGLE_DEVICE = TensorParallel()
# all_gather_into_tensor's newer name (torch 2.13 warns at the old one; torch 2.11 has only the old one)
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device) -> TensorParallel:
    """Join the group of `size` ranks (one process each) at init_method (tcp://host:port): NCCL on a GPU, gloo on
    the CPU."""
    if size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        extra = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=COLLECTIVE_TIMEOUT, **extra)
    return TensorParallel(rank, size)


def check_tensor_parallel(config, quantization: str | None, size: int) -> None:
    """A ValueError naming what cannot be split over `size` ranks: a model family without tensor parallelism, a GGUF's
    blocks as stored, a head count or FFN size that does not divide."""
    if size == 1:
        return
    if config.is_encoder_decoder:
        raise ValueError(f"tensor_parallel_size={size}: {config.architecture} (encoder-decoder) runs on one device "
                         "only; tensor parallelism covers the decoder-only families; use tensor_parallel_size=1")
    if config.latent_attention is not None:
        raise ValueError(f"tensor_parallel_size={size}: {config.architecture} (multi-head latent attention) runs on "
                         "one device only for now; use tensor_parallel_size=1")
    if config.qk_norm_over_heads:
        raise ValueError(f"tensor_parallel_size={size}: {config.architecture} normalises its queries and keys over "
                         "all heads at once, which are split over the ranks; use tensor_parallel_size=1")
    if quantization in STORED_METHODS:
        raise ValueError(f"tensor_parallel_size={size}: quantization={quantization!r} keeps the checkpoint's codes "
                         "whole and cannot split them yet; use tensor_parallel_size=1 (or quantization='int4' on a "
                         "float checkpoint, quantized per rank at load)")
    tp = TensorParallel(0, size)
    tp.shard(config.num_attention_heads, "num_attention_heads")
    tp.kv_heads(config.num_key_value_heads)
    tp.shard(config.intermediate_size, "intermediate_size")
    tp.shard(config.moe_intermediate_size, "moe_intermediate_size")
    tp.shard(config.shared_expert_intermediate_size, "shared_expert_intermediate_size")


def free_port() -> int:
    """A TCP port free on this machine now, for a group's rendezvous (init_method)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]
