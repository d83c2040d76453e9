"""Paged attention, torch backend: KV stored by slot mapping, read back through block tables.

This is the reference the Triton kernels are tested against and the path used on the CPU. The
per-step work that every layer shares (which cache slots each sequence reads, the masks) is done
once in `AttentionMetadata.build`; each layer then only gathers and calls SDPA.

Cache layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (key, value); a slot
is block_id * block_size + offset. Padding rows come last in a batch and are never stored.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillGroup:
    """One sequence with several new tokens (a prompt or a chunk of one)."""

    token_start: int
    token_end: int
    context_slots: torch.Tensor | None  # cache slots of the whole sequence; None when nothing is cached before
    mask: torch.Tensor | None  # [q, kv] causal mask offset by the cached context


@dataclass
class DecodeGroup:
    """All sequences with exactly one new token, attended to in one padded call."""

    token_index: torch.Tensor  # rows of the flat batch
    slots: torch.Tensor  # [B, max_len] cache slots (padding points at real slots and is masked)
    mask: torch.Tensor  # [B, 1, 1, max_len] True where the key is real


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    num_actual_tokens: int
    prefills: list[PrefillGroup]
    decode: DecodeGroup | None

    @staticmethod
    def build(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device, sliding_window: int | None = None) -> "AttentionMetadata":
        """query_lens[i] new tokens for sequence i, which then holds seq_lens[i] tokens in all.

        With a sliding window, a query at position p sees keys p - window < k <= p.
        """
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long)
        # every slot of every sequence, in order: [B, width * block_size]
        all_slots = (tables[:, :, None] * block_size + torch.arange(block_size)).view(len(block_tables), -1)
        seq_index = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
        positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
        slot_mapping = all_slots[seq_index, positions]
        prefills: list[PrefillGroup] = []
        decode_rows: list[int] = []
        start = 0
        for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
            context_len = seq_len - query_len
            if query_len == 1:
                decode_rows.append(i)
            elif context_len == 0 and (sliding_window is None or query_len <= sliding_window):
                prefills.append(PrefillGroup(start, start + query_len, None, None))
            else:
                key_positions = torch.arange(seq_len, device=device)
                offset = key_positions[None, :] - key_positions[context_len:, None]  # key - query position
                mask = offset <= 0
                if sliding_window is not None:
                    mask &= offset > -sliding_window
                prefills.append(PrefillGroup(start, start + query_len, all_slots[i, :seq_len].to(device), mask))
            start += query_len
        decode = None
        if decode_rows:
            rows = torch.tensor(decode_rows)
            lens = torch.tensor(seq_lens)[rows]
            longest = int(lens.max())
            token_index = torch.tensor(query_lens).cumsum(0)[rows] - 1
            key_positions = torch.arange(longest)[None, :]
            mask = key_positions < lens[:, None]
            if sliding_window is not None:
                mask &= key_positions >= lens[:, None] - sliding_window
            mask = mask[:, None, None, :]
            decode = DecodeGroup(token_index.to(device), all_slots[rows, :longest].to(device), mask.to(device))
        return AttentionMetadata(slot_mapping.to(device), start, prefills, decode)


def store_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: AttentionMetadata) -> None:
    """Write the new tokens' K/V into their slots; rows past num_actual_tokens are padding."""
    n = meta.num_actual_tokens
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    flat[0].index_copy_(0, meta.slot_mapping, key[:n])
    flat[1].index_copy_(0, meta.slot_mapping, value[:n])


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """query [T, Hq, D], key/value [T, Hkv, D] of the new tokens -> [T, Hq * D].

    The new K/V must already be stored (store_kv); cached context is read through the slots.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    for group in meta.prefills:
        q = query[group.token_start:group.token_end].transpose(0, 1)  # [Hq, q, D]
        if group.context_slots is None:  # the whole sequence is new: attend to it directly
            k = key[group.token_start:group.token_end].transpose(0, 1)
            v = value[group.token_start:group.token_end].transpose(0, 1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            k = flat[0][group.context_slots].transpose(0, 1)
            v = flat[1][group.context_slots].transpose(0, 1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale, enable_gqa=True)
        out[group.token_start:group.token_end] = o.transpose(0, 1)
    if meta.decode is not None:
        d = meta.decode
        batch, width = d.slots.shape
        group_size = num_heads // num_kv_heads
        # each KV head's query heads become rows of one query block: no K/V repeat needed
        q = query[d.token_index].view(batch, num_kv_heads, group_size, head_dim)
        k = flat[0][d.slots].permute(0, 2, 1, 3)  # [B, Hkv, L, D]
        v = flat[1][d.slots].permute(0, 2, 1, 3)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=d.mask, scale=scale)
        out[d.token_index] = o.reshape(batch, num_heads, head_dim)
    return out.view(num_tokens, num_heads * head_dim)
