"""A packed encoder batch's inputs, staged on the host in one int32 tensor so one copy sends them to the device.

Layout: [token ids | positions | cu_seqlens], sized for a capacity of tokens and sequences (a CUDA graph's
bucket, or the batch itself): token ids and positions of the padding rows are 0, and cu_seqlens past the real
sequences repeat the total, so the padding sequences are empty and the padding rows belong to none.
"""
from __future__ import annotations

from itertools import chain

import numpy as np
import torch


def stage_packed_inputs(token_ids: list[list[int]], token_capacity: int, seq_capacity: int, pin: bool
                        ) -> torch.Tensor:
    """[2 * token_capacity + seq_capacity + 1] int32 on the host (pinned if pin, for a copy that does not wait)."""
    seq_lens = np.fromiter(map(len, token_ids), dtype=np.int32, count=len(token_ids))
    total = int(seq_lens.sum())
    if total > token_capacity or len(token_ids) > seq_capacity:
        raise ValueError(f"{total} tokens in {len(token_ids)} sequences exceed the capacity of {token_capacity} "
                         f"tokens and {seq_capacity} sequences")
    host = torch.zeros(2 * token_capacity + seq_capacity + 1, dtype=torch.int32, pin_memory=pin)
    staged = host.numpy()
    staged[:total] = np.fromiter(chain.from_iterable(token_ids), dtype=np.int32, count=total)
    cu_seqlens = staged[2 * token_capacity:]
    np.cumsum(seq_lens, out=cu_seqlens[1:len(token_ids) + 1])
    cu_seqlens[len(token_ids) + 1:] = total
    # each token's position in its own sequence
    staged[token_capacity:token_capacity + total] = (np.arange(total, dtype=np.int32)
                                                     - np.repeat(cu_seqlens[:len(token_ids)], seq_lens))
    return host


def packed_inputs_on(token_ids: list[list[int]], device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token ids, positions, cu_seqlens) of exactly these sequences on device, sent in one non-blocking copy."""
    total = sum(map(len, token_ids))
    staged = stage_packed_inputs(token_ids, total, len(token_ids), pin=device.type == "cuda")
    return split_staged(staged.to(device, non_blocking=True), total)


def split_staged(staged: torch.Tensor, token_capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views (token ids, positions, cu_seqlens) of a staged tensor, on whichever device it is."""
    return staged[:token_capacity], staged[token_capacity:2 * token_capacity], staged[2 * token_capacity:]
