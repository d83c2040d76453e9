"""KV blocks copied: on the host from (source, destination) pairs, and on the device where a flag says so (Triton):
a lookahead beam step's moved slots copy their parents' partly filled blocks before the host knows which slots moved
(worker/beam_follow.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fasterllm.kernels.triton_target import interpreting

_CHUNK = 1024


@triton.jit
def _copy_flagged_blocks_kernel(cache_ptr, sources_ptr, destinations_ptr, flags_ptr, group_stride, block_stride,
                                BLOCK_WORDS: tl.constexpr, CHUNK: tl.constexpr):
    entry, group = tl.program_id(0), tl.program_id(1).to(tl.int64)
    flag = tl.load(flags_ptr + entry)
    source = tl.load(sources_ptr + entry).to(tl.int64)
    destination = tl.load(destinations_ptr + entry).to(tl.int64)
    base = cache_ptr + group * group_stride
    length = tl.where(flag != 0, BLOCK_WORDS, 0)  # an unflagged entry reads and writes nothing
    for start in range(0, BLOCK_WORDS, CHUNK):
        words = start + tl.arange(0, CHUNK)
        mask = words < length
        tl.store(base + destination * block_stride + words, tl.load(base + source * block_stride + words, mask=mask),
                 mask=mask)


def copy_blocks_on_host(caches: torch.Tensor, pairs) -> None:
    """caches: [layers, 2, blocks, ...] on the CPU; block destination of every layer's K and V becomes a copy of block
    source, for each (source, destination) pair. As bytes, whatever the cache's dtype (torch's CPU indexing has no
    fp8 kernels), one copy_ per block: torch's CPU index_copy_ is ~10x slower (RESULTS.md, issue 23)."""
    data = caches.view(torch.uint8)
    for source, destination in pairs:
        data[:, :, destination].copy_(data[:, :, source])


def copy_flagged_blocks(caches: torch.Tensor, sources: torch.Tensor, destinations: torch.Tensor,
                        flags: torch.Tensor) -> None:
    """caches: [layers, 2, blocks, ...] (any dtype); for each entry whose flag is set, block destinations[i] of every
    layer's K and V becomes a copy of block sources[i] (destinations distinct, none a flagged entry's source)."""
    if not caches.is_cuda and not interpreting():  # the host reads the flags
        entries = flags.nonzero().flatten()
        copy_blocks_on_host(caches, zip(sources[entries].tolist(), destinations[entries].tolist()))
        return
    groups, blocks = caches.shape[0] * caches.shape[1], caches.shape[2]
    words = caches.view(torch.uint8).reshape(groups, blocks, -1)
    if words.shape[2] % 4 == 0:
        words = words.view(torch.int32)
    _copy_flagged_blocks_kernel[(len(flags), groups)](words, sources, destinations, flags, words.stride(0),
                                                      words.stride(1), BLOCK_WORDS=words.shape[2], CHUNK=_CHUNK)

