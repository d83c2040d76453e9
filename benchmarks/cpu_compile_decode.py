"""Does torch.compile (inductor, C++ code) pay for CPU single-stream decode? One engine, eager and compiled steps
interleaved in rounds on the same request (the machine's noise hits both alike).

    python3 benchmarks/cpu_compile_decode.py [--quantization int8|int4|gguf] [--whole]

Default: each decoder layer's pieces around the paged attention are compiled (input norm + QKV + RoPE; o_proj +
norm + gate/up + SiLU*mul + down: inductor fuses the elementwise ops into C++ loops, the packed matmuls stay
extern calls) and attention runs eager between them; those pieces restate DecoderLayer.forward for dynamo, rotating
Q and K into a new tensor (torch.cat) where the eager layer rotates them in place. --whole: the model's whole
forward compiled for decode steps (attention inside, dynamic shapes), reporting the steps over a second (compiles)
and the graphs compiled.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch._dynamo.utils import counters

import fasterllm.models.llama as llama
from fasterllm.layers import norm
from fasterllm import SamplingParams
from fasterllm.config import EngineArgs
from fasterllm.engine.engine import Engine
from fasterllm.layers.attention import paged_attention, store_kv
from fasterllm.layers.rotary import apply_rotary


def before_attention(layer, hidden, residual, cos, sin):
    hidden, residual = layer.input_layernorm(hidden, residual)
    attn = layer.attn
    qkv = layer.qkv_proj(hidden).view(hidden.shape[0], attn.num_heads + 2 * attn.num_kv_heads, attn.head_dim)
    rotated = attn.num_heads + attn.num_kv_heads
    return torch.cat([apply_rotary(qkv[:, :rotated], cos, sin), qkv[:, rotated:]], dim=1), residual


def after_attention(layer, attention, residual):
    hidden, residual = layer.post_attention_layernorm(layer.o_proj(attention), residual)
    return layer.down_proj(layer.act(layer.gate_up_proj(hidden))), residual


def use_pieces(pieces):
    """DecoderLayer's torch path with its two halves taken from pieces (eager or compiled); RMSNorm written out
    (dynamo cannot trace torch._fused_rms_norm; inductor fuses the written-out form anyway)."""
    norm._fused_fp32_rms_norm = None
    def forward(layer, hidden, residual, rope, kv_cache, meta):
        if residual is None:  # the first layer: one graph for every layer
            residual = torch.zeros_like(hidden)
        qkv, residual = pieces[0](layer, hidden, residual, *rope)
        attn = layer.attn
        query, key, value = qkv.split_with_sizes([attn.num_heads, attn.num_kv_heads, attn.num_kv_heads], dim=1)
        store_kv(kv_cache, qkv[:, attn.num_heads:], meta)
        attention = paged_attention(query, key, value, kv_cache, meta, attn.scale)
        return pieces[1](layer, attention, residual)
    llama.DecoderLayer.forward = forward


def use_whole(model):
    """The decode steps' forward compiled whole (RMSNorm written out, as in use_pieces); prompts eager."""
    norm._fused_fp32_rms_norm = None
    eager, compiled = model.forward, torch.compile(model.forward)

    def forward(input_ids, positions, kv_caches, meta, rows):
        decoding = not meta.prefills and meta.decode is not None
        return (compiled if decoding else eager)(input_ids, positions, kv_caches, meta, rows)
    model.forward = forward


def timed_steps(engine: Engine, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--whole", action="store_true", help="compile the whole decode forward (takes minutes)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(2)
    eager_layer_forward, eager_norm = llama.DecoderLayer.forward, norm._fused_fp32_rms_norm
    engine = Engine(EngineArgs(model=None, dtype="bfloat16", device="cpu", quantization=args.quantization))
    new_tokens = 4 + args.rounds * args.steps * (1 if args.whole else 2)
    engine.add_request("r", list(range(100, 132)), SamplingParams(temperature=0, max_tokens=new_tokens,
                                                                  ignore_eos=True))
    engine.step()  # the prompt, eager
    if args.whole:
        use_whole(engine.executor.runner.model)
        for step in range(args.rounds * args.steps):
            start = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - start
            if seconds > 1:
                print(f"decode step {step}: {seconds:.1f} s", flush=True)  # a compile, or a slow compiled step
        print(f"graphs compiled: {counters['stats']['unique_graphs']}; steps over 1 s are listed above")
        return
    eager = (before_attention, after_attention)
    compiled = tuple(torch.compile(piece) for piece in eager)
    use_pieces(compiled)
    start = time.perf_counter()
    engine.step()
    print(f"first compiled step {time.perf_counter() - start:.1f} s")
    engine.step()
    times: dict[str, list[float]] = {"eager (DecoderLayer.forward)": [], "compiled pieces": []}
    for _ in range(args.rounds):
        llama.DecoderLayer.forward, norm._fused_fp32_rms_norm = eager_layer_forward, eager_norm
        times["eager (DecoderLayer.forward)"].append(timed_steps(engine, args.steps))
        use_pieces(compiled)
        times["compiled pieces"].append(timed_steps(engine, args.steps))
    for name, values in times.items():
        print(f"{args.quantization or 'bf16'} {name}: median {statistics.median(values):.2f} ms a step, rounds "
              f"{', '.join(f'{v:.2f}' for v in values)}")
    print(f"graphs compiled: {counters['stats']['unique_graphs']} (2 = one per piece, no recompiles)")


if __name__ == "__main__":
    main()
