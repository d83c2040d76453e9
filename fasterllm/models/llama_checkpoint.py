"""A LLaMA-family checkpoint into LlamaForCausalLM: Hugging Face names to ours, q/k/v and gate/up fused as they
arrive (Phi-3's stored-fused tensors split first, so every checkpoint shards alike), each tensor-parallel rank's part
read alone, experts stacked, Gemma's (1 + weight) norms stored as plain ones, and every parameter checked filled."""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from fasterllm.config import ModelConfig
from fasterllm.layers.quantization.stored import INPUT_INDEXED
from fasterllm.loader.weight_parts import WeightSource, read_part, read_whole, shape_of

if TYPE_CHECKING:
    from fasterllm.models.llama import LlamaForCausalLM


@torch.no_grad()
def load_llama_weights(model: LlamaForCausalLM, weights: Iterable[tuple[str, WeightSource]]) -> None:
    """Copy checkpoint tensors (Hugging Face names) in, fusing q/k/v and gate/up as they arrive; with tensor
    parallelism, read only this rank's part of each (loader/weight_parts.py)."""
    cfg, fused = model.config, model.layers[0].fused_parts
    params = dict(model.named_parameters())
    # each rank's share of an expert's (and the shared expert's) intermediate size
    sizes = {"w_gate_up": cfg.moe_intermediate_size // model.tp.size,
             "shared_gate_up": cfg.shared_expert_intermediate_size // model.tp.size}
    expected = set()
    for pname in params:
        if ".moe." in pname:
            expected.update(_expert_parts(pname, cfg, sizes))
            continue
        kind = pname.split(".")[-2]
        starts = [start for new, start, _ in fused.values() if new == kind]
        if starts:
            expected.update(f"{pname}#{start}" for start in starts)
        else:
            expected.add(pname)
    loaded, input_indexed_from = set(), {}  # fused projection's input-indexed tensor -> the name that filled it
    for name, source in _unfused(weights, cfg):
        target, rows, shared_part = _our_name(name), None, None
        if target.endswith(".rotary_emb.inv_freq") or (target == "lm_head.weight" and model.lm_head is None):
            continue  # a RoPE table we compute, or a copy of the tied embedding
        expert_part = _expert_target(target, cfg, sizes)
        if expert_part is not None:  # a router, an expert's or the shared expert's projection
            pname, expert, rows = expert_part
            tensor = _expert_rank_part(model.tp, pname, rows, source)
            loaded.add(_copy_expert_part(params, pname, expert, rows, tensor, name))
            continue
        parts = target.split(".")
        kind = parts[-2] if len(parts) >= 2 else ""
        if kind in fused:
            new, start, size = fused[kind]
            target = ".".join(parts[:-2] + [new, parts[-1]])
            if parts[-1] in INPUT_INDEXED:  # one for the fused projection: each part's must be the same
                shared_part = start
            else:
                rows = (start, size)
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} does not belong to a {cfg.architecture} "
                             "with this config; the checkpoint and its config disagree")
        tensor = _rank_part(model, kind, parts[-1], source)
        param = params[target]
        dest = param if rows is None else param.narrow(0, *rows)
        if kind in ("embed_tokens", "lm_head") and tensor.shape[0] < dest.shape[0]:
            dest[tensor.shape[0]:].zero_()  # the last rank's rows past the vocabulary
            dest = dest[:tensor.shape[0]]
        if dest.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {shape_of(source)} but the config "
                             f"implies {tuple(dest.shape)} (this rank's part); the checkpoint and its config "
                             "disagree")
        if shared_part is not None:  # the first part's fills it, the others' must equal it
            first = input_indexed_from.setdefault(target, name)
            loaded.add(f"{target}#{shared_part}")
            if first != name:
                if not torch.equal(dest, tensor.to(dest.device)):
                    raise ValueError(f"checkpoint tensors {first!r} and {name!r} differ, but "
                                     f"{target.rsplit('.', 1)[0]} fuses these projections of one input, so the order "
                                     "of their inputs (from GPTQ act-order's g_idx) must agree; quantize the "
                                     "projections of one input with one g_idx (as GPTQ does: the order comes from the "
                                     "input's Hessian), or with desc_act=False")
                continue
        dest.copy_(tensor)
        if cfg.norm_plus_one and parts[-1] == "weight" and kind.endswith("norm"):
            dest.add_(1.0)  # Gemma's norms multiply by (1 + weight): stored so, the norm is the usual one
        if shared_part is None:
            loaded.add(target if rows is None else f"{target}#{rows[0]}")
    missing = expected - loaded
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}; "
                         "the file is incomplete or for another architecture")

def _rank_part(model: LlamaForCausalLM, kind: str, leaf: str, source: WeightSource) -> torch.Tensor:
    """This rank's part of a checkpoint tensor of module `kind` (q_proj, o_proj, embed_tokens, ...): rows of the
    column-parallel projections, columns of the row-parallel ones (whose bias rank 0 alone adds), rows of the
    vocabulary; the norms whole."""
    tp, cfg = model.tp, model.config
    if tp.size == 1:
        return read_whole(source)
    layer = model.layers[0]
    q_size, intermediate = layer.num_q_heads * cfg.head_dim, layer.intermediate_size
    kv_first = tp.kv_heads(cfg.num_key_value_heads)[0] * cfg.head_dim
    rows = {"q_proj": (tp.rank * q_size, q_size), "k_proj": (kv_first, layer.num_kv_heads * cfg.head_dim),
            "gate_proj": (tp.rank * intermediate, intermediate)}
    rows["v_proj"], rows["up_proj"] = rows["k_proj"], rows["gate_proj"]
    if kind in rows:
        return read_part(source, 0, *rows[kind])
    if kind in ("o_proj", "down_proj"):
        if leaf == "bias":
            return read_whole(source) if tp.rank == 0 else torch.zeros(shape_of(source))
        size = q_size if kind == "o_proj" else intermediate
        return read_part(source, 1, tp.rank * size, size)
    if kind in ("embed_tokens", "lm_head"):
        first, per_rank = tp.vocab_rows(cfg.vocab_size)
        return read_part(source, 0, first, min(per_rank, cfg.vocab_size - first))
    return read_whole(source)


def _unfused(weights: Iterable[tuple[str, WeightSource]], cfg: ModelConfig
             ) -> Iterable[tuple[str, WeightSource]]:
    """The stream with tensors stored fused (Phi-3's qkv_proj and gate_up_proj) split into the q/k/v and gate/up
    tensors the loader fuses again, so every checkpoint is sharded the same way."""
    q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    pieces = {"qkv_proj": (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)),
              "gate_up_proj": (("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size))}
    for name, source in weights:
        parts = name.split(".")
        if len(parts) < 2 or parts[-2] not in pieces:
            yield name, source
            continue
        tensor, start = read_whole(source), 0
        for piece, size in pieces[parts[-2]]:
            # an input-indexed tensor (a stored-fused projection's input order) is each piece's whole
            part = tensor if parts[-1] in INPUT_INDEXED else tensor.narrow(0, start, size)
            yield ".".join(parts[:-2] + [piece, parts[-1]]), part
            start += size


_EXPERT_ROWS = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}  # Mixtral's / Qwen's names: gate, then up rows


def _expert_target(target: str, cfg: ModelConfig, sizes: dict[str, int]
                   ) -> tuple[str, int | None, tuple[int, int] | None] | None:
    """A mixture of experts' tensor (our name before fusion) -> (our parameter, expert index or None, (first row,
    rows) of this rank's fused gate/up or None), or None for any other tensor. sizes: this rank's intermediate size of
    an expert ("w_gate_up") and of the shared expert ("shared_gate_up")."""
    parts = target.split(".")
    if cfg.num_experts == 0 or len(parts) < 4 or parts[0] != "layers":
        return None
    moe, rest = f"layers.{parts[1]}.moe", [p for p in parts[2:-1] if p != "block_sparse_moe"]
    if rest == ["gate"]:
        return f"{moe}.router", None, None
    if rest == ["shared_expert_gate"]:
        return f"{moe}.shared_expert_gate", None, None
    size = sizes["shared_gate_up"]
    if len(rest) == 2 and rest[0] in ("shared_expert", "shared_experts"):  # Qwen2-MoE's, DeepSeek's
        if rest[1] == "down_proj":
            return f"{moe}.shared_down.weight", None, None
        return f"{moe}.shared_gate_up.weight", None, (_EXPERT_ROWS[rest[1]] * size, size)
    if len(rest) == 3 and rest[0] == "experts":
        expert, size = int(rest[1]), sizes["w_gate_up"]
        if rest[2] in ("w2", "down_proj"):
            return f"{moe}.w_down", expert, None
        return f"{moe}.w_gate_up", expert, (_EXPERT_ROWS[rest[2]] * size, size)
    return None


def _expert_parts(pname: str, cfg: ModelConfig, sizes: dict[str, int]) -> list[str]:
    """The keys _copy_expert_part marks loaded for parameter pname of a SparseMoE."""
    kind = pname.removesuffix(".weight").rsplit(".", 1)[-1]
    experts = [f"#{e}" for e in range(cfg.num_experts)] if kind in ("w_gate_up", "w_down") else [""]
    # the gate and up halves start at row 0 and at row `size` of a fused gate/up
    size = sizes.get(kind)
    rows = [""] if size is None else ["#0", f"#{size}"]
    return [f"{pname}{e}{r}" for e in experts for r in rows]


def _expert_rank_part(tp, pname: str, rows: tuple[int, int] | None, source: WeightSource) -> torch.Tensor:
    """This rank's part of an expert tensor: rows of a gate or up projection (rows given: its half of the fused
    gate/up), columns of a down projection, the router and the shared expert's gate whole."""
    if tp.size == 1 or pname.endswith((".router", ".shared_expert_gate")):
        return read_whole(source)
    size = rows[1] if rows is not None else shape_of(source)[1] // tp.size
    return read_part(source, 0 if rows is not None else 1, tp.rank * size, size)


def _copy_expert_part(params: dict, pname: str, expert: int | None, rows: tuple[int, int] | None,
                      tensor: torch.Tensor, name: str) -> str:
    """Copy one checkpoint tensor into its expert's slice of pname; the key it fills (as _expert_parts lists it)."""
    dest, key = params[pname], pname
    if expert is not None:
        dest, key = dest[expert], f"{key}#{expert}"
    if rows is not None:
        dest, key = dest.narrow(0, *rows), f"{key}#{rows[0]}"
    if dest.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)} but the config implies "
                         f"{tuple(dest.shape)}; the checkpoint and its config disagree")
    dest.copy_(tensor)
    return key


def _our_name(hf_name: str) -> str:
    """Hugging Face parameter name -> ours (before q/k/v and gate/up fusion)."""
    name = hf_name.removeprefix("model.")
    for hf_part, ours in ((".self_attn.o_proj.", ".o_proj."), (".mlp.down_proj.", ".down_proj."),
                          (".self_attn.", "."), (".mlp.", ".")):
        name = name.replace(hf_part, ours)
    return name
