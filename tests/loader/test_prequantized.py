"""GPTQ and AWQ checkpoints run as stored: the test writes each format's documented packing of a tiny Llama's
projections, quantized here (GPTQ: qweight packed along inputs, qzeros stored minus one in v1, fp16 scales, g_idx;
AWQ: qweight and qzeros packed along outputs in AutoAWQ's nibble order); the engine's logits equal transformers' on
the dequantized float weights (to the int4 kernel's bf16), its codes equal the test's, and what it does not run is
an error naming it."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "parity"))
from parity_utils import TINY_SPECS, assert_prompt_logprobs_match, build_tiny_model, random_prompt  # noqa: E402

from fasterllm import LLM  # noqa: E402
from fasterllm.loader.prequantized import stored_quantization  # noqa: E402

pytest.importorskip("transformers")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STORED_FUSED = ("qkv_proj", "gate_up_proj")  # Phi-3's checkpoints store these fused
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble j of a word holds column 8 i + AWQ_ORDER[j]


def gptq_quantize(weight: np.ndarray, group_size: int, sym: bool, order: np.ndarray | None = None, bits: int = 4):
    """weight [N, K] -> (codes [K, N], zeros [G, N], fp16 scales [G, N], dequantized [N, K], g_idx [K]): GPTQ's round
    to nearest of each group of inputs (asymmetric: min/max; symmetric: zero point 2 ** (bits - 1)). order: the inputs
    in the order they are quantized (act-order: groups of consecutive inputs of that order); None: as stored."""
    n, k = weight.shape
    group, top = (k if group_size == -1 else group_size), 2 ** bits - 1
    order = np.arange(k) if order is None else order
    grouped = weight.T[order].reshape(k // group, group, n)
    if sym:
        scales = (np.abs(grouped).max(axis=1) * 2 / top).astype(np.float16)
        zeros = np.full(scales.shape, (top + 1) // 2, dtype=np.int64)
    else:
        low, high = grouped.min(axis=1), grouped.max(axis=1)
        scales = ((high - low) / top).astype(np.float16)
        zeros = np.clip(np.round(-low / scales.astype(np.float32)), 0, top).astype(np.int64)
    s = scales.astype(np.float32)[:, None, :]
    sorted_codes = np.clip(np.round(grouped / s) + zeros[:, None, :], 0, top).astype(np.int64)
    codes, dequantized, g_idx = np.empty((k, n), np.int64), np.empty((k, n), np.float32), np.empty(k, np.int64)
    codes[order] = sorted_codes.reshape(k, n)
    dequantized[order] = ((sorted_codes - zeros[:, None, :]) * s).reshape(k, n)
    g_idx[order] = np.arange(k) // group
    return codes, zeros, scales, dequantized.T, g_idx


def pack_rows(values: np.ndarray, bits: int = 4) -> np.ndarray:
    """[R, C] codes -> int32 [R / (32 / bits), C], row (32 / bits) i + j in bits (bits j) of row i (qweight)."""
    per_word = 32 // bits
    shifted = values.reshape(values.shape[0] // per_word, per_word, values.shape[1]) << (
        bits * np.arange(per_word))[None, :, None]
    return np.ascontiguousarray(shifted.sum(axis=1).astype(np.uint32).view(np.int32))


def gptq_dequantize(tensors: dict[str, torch.Tensor], module: str, bits: int, checkpoint_format: str) -> torch.Tensor:
    """The float weight [N, K] of a stored GPTQ projection, by the format's own formula, read from the packed
    tensors: weight[n, k] = scales[g_idx[k], n] * (code[k, n] - zero[g_idx[k], n]) (no sorting, no grouping)."""
    mask, per_word = 2 ** bits - 1, 32 // bits
    shifts = (bits * np.arange(per_word)).astype(np.uint32)
    words = tensors[f"{module}.qweight"].numpy().view(np.uint32)  # [K / per_word, N]
    codes = ((words[:, None, :] >> shifts[None, :, None]) & mask).reshape(-1, words.shape[1]).astype(np.int64)
    zero_words = tensors[f"{module}.qzeros"].numpy().view(np.uint32)  # [G, N / per_word]
    zeros = ((zero_words[:, :, None] >> shifts) & mask).reshape(zero_words.shape[0], -1).astype(np.int64)
    zeros += 1 if checkpoint_format == "gptq" else 0  # v1 stores zero - 1
    g_idx = tensors[f"{module}.g_idx"].numpy().astype(np.int64)
    scales = tensors[f"{module}.scales"].numpy().astype(np.float32)
    return torch.from_numpy((scales[g_idx] * (codes - zeros[g_idx])).T.copy())


def pack_columns_awq(values: np.ndarray) -> np.ndarray:
    """[R, C] codes -> int32 [R, C / 8] as AutoAWQ packs them: word i holds column 8 i + AWQ_ORDER[j] in bits 4 j."""
    words = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.int64)
    for i in range(words.shape[1]):
        for j, column in enumerate(AWQ_ORDER):
            words[:, i] |= values[:, 8 * i + column] << (4 * j)
    return np.ascontiguousarray(words.astype(np.uint32).view(np.int32))


def write_quantized(directory: Path, model, group_size: int, sym: bool, checkpoint_format: str = "gptq",
                    act_order: bool = False, bits: int = 4, seed: int = 0):
    """Save model's projections as GPTQ (checkpoint_format "gptq" or "gptq_v2") or AWQ ("awq"), the rest float,
    with the quantization_config; load the dequantized weights into model (the reference); return each projection's
    codes [K, N]. act_order (GPTQ): each input of a layer quantized in a random order (one per input: q/k/v share
    theirs, as gate/up do, as GPTQ's Hessian of the input gives them), g_idx saying each input's group."""
    from safetensors.torch import save_file

    tensors, codes_of, orders = {}, {}, {}
    rng = np.random.default_rng(seed)
    for name, tensor in model.state_dict().items():
        module = name.removesuffix(".weight")
        kind = module.rsplit(".", 1)[-1]
        if kind not in PROJECTIONS + STORED_FUSED:
            tensors[name] = tensor.contiguous()
            continue
        shared_input = module.rsplit(".", 2)[0] + {"k_proj": ".q_proj", "v_proj": ".q_proj",
                                                    "up_proj": ".gate_proj"}.get(kind, "." + kind)
        order = orders.setdefault(shared_input, rng.permutation(tensor.shape[1])) if act_order else None
        codes, zeros, scales, dequantized, g_idx = gptq_quantize(tensor.numpy(), group_size, sym, order, bits)
        tensors[f"{module}.scales"] = torch.from_numpy(np.ascontiguousarray(scales))
        if checkpoint_format == "awq":
            tensors[f"{module}.qweight"] = torch.from_numpy(pack_columns_awq(codes))
            tensors[f"{module}.qzeros"] = torch.from_numpy(pack_columns_awq(zeros))
        else:
            stored_zeros = zeros - (1 if checkpoint_format == "gptq" else 0)
            tensors[f"{module}.qweight"] = torch.from_numpy(pack_rows(codes, bits))
            tensors[f"{module}.qzeros"] = torch.from_numpy(np.ascontiguousarray(pack_rows(stored_zeros.T, bits).T))
            tensors[f"{module}.g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
            # the reference: the stored tensors dequantized by the format's formula, independently of the loader
            assert torch.equal(gptq_dequantize(tensors, module, bits, checkpoint_format), torch.from_numpy(dequantized))
        with torch.no_grad():
            tensor.copy_(torch.from_numpy(dequantized))
        codes_of[module] = codes
    for old in directory.glob("*.safetensors"):
        old.unlink()
    save_file(tensors, str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    if checkpoint_format == "awq":
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                         "zero_point": True, "version": "gemm"}
    else:
        config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                                         "desc_act": act_order, "sym": sym, "checkpoint_format": checkpoint_format}
    (directory / "config.json").write_text(json.dumps(config))
    return codes_of


@pytest.mark.parametrize("group_size, sym, checkpoint_format", [(32, False, "gptq"), (64, True, "gptq"),
                                                                 (-1, False, "gptq_v2"), (32, False, "awq"),
                                                                 (64, False, "awq")])
def test_a_prequantized_checkpoint_runs_as_its_dequantized_weights(tmp_path, group_size, sym, checkpoint_format):
    spec = next(s for s in TINY_SPECS if s.name == "llama3_gqa")
    model = build_tiny_model(spec, tmp_path)
    codes_of = write_quantized(tmp_path, model, group_size, sym, checkpoint_format)
    unpacked = dict(stored_quantization(tmp_path).weights(tmp_path))
    for module, codes in codes_of.items():  # the loader's unpacking against the test's packing
        assert torch.equal(unpacked[f"{module}.qcodes"], torch.from_numpy(codes.T.astype(np.uint8)))
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=64)
    assert type(llm.engine.executor.runner.model.layers[0].qkv_proj).__name__ == "Int4WeightOnlyLinear"
    # the int4 kernel multiplies bf16 activations: logprobs within a few hundredths of the float model's
    assert_prompt_logprobs_match(llm, model, [random_prompt(n, spec.vocab_size, 300 + n) for n in (5, 23)], 0.08)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("group_size, sym, checkpoint_format", [(-1, True, "gptq"), (64, False, "awq")])
def test_on_the_gpu_a_prequantized_checkpoint_runs_as_its_dequantized_weights(tmp_path, group_size, sym,
                                                                              checkpoint_format):
    spec = next(s for s in TINY_SPECS if s.name == "llama3_gqa")
    model = build_tiny_model(spec, tmp_path)
    write_quantized(tmp_path, model, group_size, sym, checkpoint_format)
    llm = LLM(str(tmp_path), dtype="bfloat16", device="cuda", num_kv_blocks=64, gpu_memory_utilization=0.2)
    assert type(llm.engine.executor.runner.model.layers[0].qkv_proj).__name__ == "Int4GPULinear"
    # bf16 activations against fp32
    assert_prompt_logprobs_match(llm, model, [random_prompt(23, spec.vocab_size, 323)], 0.2)


def test_what_the_support_does_not_cover_is_an_error_naming_it(tmp_path):
    spec = next(s for s in TINY_SPECS if s.name == "llama3_gqa")
    model = build_tiny_model(spec, tmp_path)
    write_quantized(tmp_path, model, 32, False)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    for change, message in (({"bits": 3}, "GPTQ checkpoint of bits=3, group_size=32; supported: GPTQ \\(4- or 8-bit"),
                            ({"bits": 8, "group_size": 16}, "GPTQ checkpoint of bits=8, group_size=16; supported"),
                            ({"quant_method": "awq", "bits": 8}, "AWQ checkpoint of bits=8, group_size=32; supported"),
                            ({"group_size": 16}, "bits=4, group_size=16; supported"),
                            ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes', which is not supported"),
                            ({"quant_method": "awq", "version": "gemv"}, "AWQ checkpoint of version='gemv'")):
        config_path.write_text(json.dumps({**config, "quantization_config": {**config["quantization_config"],
                                                                             **change}}))
        with pytest.raises(ValueError, match=message):
            LLM(str(tmp_path), device="cpu", num_kv_blocks=16)
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="is a GPTQ checkpoint, which runs as stored; quantization='int8'"):
        LLM(str(tmp_path), device="cpu", quantization="int8", num_kv_blocks=16)


# ---- GPTQ act-order (desc_act: g_idx out of group order) ----------------------------------------------------------

# wide enough that every input width divides into groups of 128: hidden 256, q/o 4 heads x 64, gate/up/down 512
WIDE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
GREEDY_TOKENS = 8


def loaded_weight(unpacked: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """The loader's codes * scale + minimum [N, K] (in the groups it holds), its columns put back in stored order by
    qorder."""
    codes = unpacked[f"{module}.qcodes"]
    repeat = lambda t: t.repeat_interleave(codes.shape[1] // t.shape[1], dim=1)  # noqa: E731
    sorted_weight = unpacked[f"{module}.qcodes"].float() * repeat(unpacked[f"{module}.qscales"]) + repeat(
        unpacked[f"{module}.qmins"])
    weight = torch.empty_like(sorted_weight)
    weight[:, unpacked[f"{module}.qorder"]] = sorted_weight
    return weight


def greedy_reference(hf_model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def assert_runs_as_reference(llm, model, vocab_size: int, logprob_atol: float, greedy: bool) -> None:
    from fasterllm import SamplingParams

    prompts = [random_prompt(n, vocab_size, 400 + n) for n in (6, 21)]
    assert_prompt_logprobs_match(llm, model, prompts, logprob_atol)
    if greedy:  # fp32 products: the same argmax as the float model at every step
        params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, output in zip(prompts, outputs):
            assert list(output.outputs[0].token_ids) == greedy_reference(model, prompt, GREEDY_TOKENS)


@pytest.mark.parametrize("spec_name, group_size, sym, checkpoint_format", [
    ("llama3_gqa", 32, False, "gptq"), ("llama3_gqa", 64, True, "gptq_v2"), ("llama3_gqa", 128, False, "gptq_v2"),
    ("llama3_gqa", 128, True, "gptq"), ("llama3_gqa", -1, False, "gptq"),
    ("phi3_fused", 64, False, "gptq")])  # q/k/v and gate/up stored fused: one g_idx each
# cpu_kernels_on (conftest): our C++ kernel, the exact product of the stored weights up to fp32 sums, so the engine's
# logits meet the float reference tightly
def test_an_act_order_checkpoint_runs_as_its_dequantized_weights(tmp_path, cpu_kernels_on, spec_name, group_size,
                                                                 sym, checkpoint_format):
    from safetensors.torch import load_file

    spec = next(s for s in TINY_SPECS if s.name == spec_name)
    model = build_tiny_model(spec, tmp_path, **WIDE)
    codes_of = write_quantized(tmp_path, model, group_size, sym, checkpoint_format, act_order=True)
    stored = load_file(str(tmp_path / "model.safetensors"))
    unpacked = dict(stored_quantization(tmp_path).weights(tmp_path))
    for module in codes_of:  # the loader's sorted codes and scales are the stored weight, exactly
        assert torch.equal(loaded_weight(unpacked, module), gptq_dequantize(stored, module, 4, checkpoint_format))
        # in the checkpoint's own groups (a whole row: the widest the layer holds, 256 here)
        held = 256 if group_size == -1 else group_size
        assert unpacked[f"{module}.qscales"].shape[1] == unpacked[f"{module}.qcodes"].shape[1] // held
        in_group_order = torch.equal(unpacked[f"{module}.qorder"], torch.arange(len(unpacked[f"{module}.qorder"])))
        assert in_group_order == (group_size == -1)  # one group: every order is group order
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=64)
    qkv = llm.engine.executor.runner.model.layers[0].qkv_proj
    if group_size == -1:
        assert type(qkv).__name__ == "Int4WeightOnlyLinear"
    else:
        assert type(qkv).__name__ == "InputOrderedLinear" and type(qkv.layer).__name__ == "Int4WeightOnlyLinear"
        assert qkv.layer.native is not None
    assert_runs_as_reference(llm, model, spec.vocab_size, 1e-3, greedy=True)


def test_an_act_order_checkpoint_on_torchs_int4_kernel(tmp_path, monkeypatch):
    from fasterllm.kernels.native import cpu_extension

    spec = next(s for s in TINY_SPECS if s.name == "llama3_gqa")
    model = build_tiny_model(spec, tmp_path, **WIDE)
    write_quantized(tmp_path, model, 128, False, "gptq", act_order=True)
    monkeypatch.setenv(cpu_extension.ISA_ENV, "off")
    cpu_extension.kernel_isa.cache_clear()
    try:
        llm = LLM(str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=64)
    finally:
        monkeypatch.undo()
        cpu_extension.kernel_isa.cache_clear()
    down = llm.engine.executor.runner.model.layers[1].down_proj
    assert type(down).__name__ == "InputOrderedLinear" and down.layer.native is None
    # torch's kernel multiplies bf16 activations: logprobs within a few hundredths of the float model's
    assert_runs_as_reference(llm, model, spec.vocab_size, 0.08, greedy=False)


def test_act_order_that_cannot_run_is_an_error_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    spec = next(s for s in TINY_SPECS if s.name == "llama3_gqa")
    model = build_tiny_model(spec, tmp_path, **WIDE)
    write_quantized(tmp_path, model, 64, False, "gptq", act_order=True)
    path = str(tmp_path / "model.safetensors")
    original = load_file(path)
    # tensor parallelism does not split stored codes (a row-parallel o_proj / down_proj's sorted inputs least of all)
    with pytest.raises(ValueError, match="tensor_parallel_size=2: quantization='gptq' keeps the checkpoint's codes "
                                         "whole.*use tensor_parallel_size=1"):
        LLM(str(tmp_path), device="cpu", num_kv_blocks=16, tensor_parallel_size=2)
    # q/k/v fused into one projection of one input need one input order
    k_name = "model.layers.1.self_attn.k_proj"
    tensors = dict(original)
    tensors[f"{k_name}.g_idx"] = torch.arange(256, dtype=torch.int32) // 64  # k's codes still as stored: another order
    save_file(tensors, path)
    with pytest.raises(ValueError, match="'model.layers.1.self_attn.[qk]_proj.qorder' and 'model.layers.1.self_attn."
                                         "[qk]_proj.qorder' differ, but layers.1.qkv_proj fuses these projections"):
        LLM(str(tmp_path), device="cpu", num_kv_blocks=16)
    # a g_idx that does not make groups of group_size inputs
    tensors = dict(original)
    tensors["model.layers.0.mlp.down_proj.g_idx"] = torch.zeros(512, dtype=torch.int32)
    save_file(tensors, path)
    with pytest.raises(ValueError, match="'model.layers.0.mlp.down_proj': g_idx \\(512 entries, groups 0..0\\) does "
                                         "not put 64 of its 512 inputs in each of its 8 groups; the checkpoint"):
        LLM(str(tmp_path), device="cpu", num_kv_blocks=16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])  # tinygemm's layout (bf16), the Triton kernels' (fp16)
def test_on_the_gpu_an_act_order_checkpoint_runs_as_its_dequantized_weights(tmp_path, dtype):
    spec = next(s for s in TINY_SPECS if s.name == "llama3_gqa")
    model = build_tiny_model(spec, tmp_path, **WIDE)
    write_quantized(tmp_path, model, 128, False, "gptq_v2", act_order=True)
    llm = LLM(str(tmp_path), dtype=dtype, device="cuda", num_kv_blocks=64, gpu_memory_utilization=0.2)
    qkv = llm.engine.executor.runner.model.layers[0].qkv_proj
    assert type(qkv).__name__ == "InputOrderedLinear" and type(qkv.layer).__name__ == "Int4GPULinear"
    assert qkv.layer.tinygemm == (dtype == "bfloat16")
    # 16-bit activations against fp32: prompt rows, then decode rows (through the CUDA graphs): each generated
    # token's logprob against the float model's on the same tokens
    assert_prompt_logprobs_match(llm, model, [random_prompt(n, spec.vocab_size, 400 + n) for n in (5, 23)], 0.2)
    from fasterllm import SamplingParams

    prompt = random_prompt(9, spec.vocab_size, 9)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS,
                                                                      ignore_eos=True, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    tokens = list(out.token_ids)
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0].float(), dim=-1)
    expected = reference[torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1), torch.tensor(tokens)]
    ours = torch.tensor([entry[token].logprob for entry, token in zip(out.logprobs, tokens)])
    assert len(tokens) == GREEDY_TOKENS
    torch.testing.assert_close(ours, expected, atol=0.2, rtol=0.02)


# ---- GPTQ 8-bit: per channel and symmetric as the int8 layer, else as uint8_grouped ----------------------------------

@pytest.mark.parametrize("group_size, sym, checkpoint_format, act_order, layer", [
    (-1, True, "gptq", True, "Int8WeightOnlyLinear"), (-1, True, "gptq_v2", False, "Int8WeightOnlyLinear"),
    (-1, False, "gptq", True, "Uint8GroupedLinear"), (32, False, "gptq_v2", True, "Uint8GroupedLinear"),
    (64, True, "gptq", True, "Uint8GroupedLinear"), (128, False, "gptq", True, "Uint8GroupedLinear"),
    (128, True, "gptq_v2", False, "Uint8GroupedLinear")])
def test_an_8bit_gptq_checkpoint_runs_as_its_dequantized_weights(tmp_path, cpu_kernels_on, group_size, sym,
                                                                 checkpoint_format, act_order, layer):
    from safetensors.torch import load_file

    spec = next(s for s in TINY_SPECS if s.name == "llama3_gqa")
    model = build_tiny_model(spec, tmp_path, **WIDE)
    codes_of = write_quantized(tmp_path, model, group_size, sym, checkpoint_format, act_order=act_order, bits=8)
    stored = load_file(str(tmp_path / "model.safetensors"))
    unpacked = dict(stored_quantization(tmp_path).weights(tmp_path))
    for module, codes in codes_of.items():  # the loader's codes times scales (plus minimums) are the stored weight
        if layer == "Int8WeightOnlyLinear":  # the stored codes less 128
            assert torch.equal(unpacked[f"{module}.qweight"], torch.from_numpy(codes.T - 128).to(torch.int8))
            weight = unpacked[f"{module}.qweight"].float() * unpacked[f"{module}.qscales"][:, None]
        else:
            weight = loaded_weight(unpacked, module)
        assert torch.equal(weight, gptq_dequantize(stored, module, 8, checkpoint_format))
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=64)
    qkv = llm.engine.executor.runner.model.layers[0].qkv_proj
    ordered = act_order and group_size != -1  # one group: every order is group order
    assert type(qkv).__name__ == ("InputOrderedLinear" if ordered else layer)
    assert type(qkv.layer if ordered else qkv).__name__ == layer
    # fp32 products (our C++ int8 kernel; uint8_grouped's dequantized fp32 weight): tight, and the same greedy tokens
    assert_runs_as_reference(llm, model, spec.vocab_size, 1e-3, greedy=True)


def test_8bit_gptq_that_says_symmetric_and_is_not_is_an_error_naming_it(tmp_path):
    spec = next(s for s in TINY_SPECS if s.name == "llama3_gqa")
    model = build_tiny_model(spec, tmp_path)
    write_quantized(tmp_path, model, -1, False, "gptq", bits=8)  # zero points from each row's min and max
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["sym"] = True  # the config says symmetric, the codes are not
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPTQ projection 'model.layers.0.[a-z_]+.[a-z_]+' has zero points "
                                         "\\[.*\\] \\(after the checkpoint format's offset 1\\), not 128 "
                                         "throughout, but its quantization_config does not say sym=false"):
        LLM(str(tmp_path), device="cpu", num_kv_blocks=16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("group_size, sym, layer", [(-1, True, "Int8GPULinear"), (128, False, "Uint8GroupedGPULinear")])
def test_on_the_gpu_an_8bit_gptq_checkpoint_runs_as_its_dequantized_weights(tmp_path, group_size, sym, layer):
    spec = next(s for s in TINY_SPECS if s.name == "llama3_gqa")
    model = build_tiny_model(spec, tmp_path, **WIDE)
    write_quantized(tmp_path, model, group_size, sym, "gptq", act_order=True, bits=8)
    llm = LLM(str(tmp_path), dtype="bfloat16", device="cuda", num_kv_blocks=64, gpu_memory_utilization=0.2)
    qkv = llm.engine.executor.runner.model.layers[0].qkv_proj
    assert type(qkv.layer if group_size != -1 else qkv).__name__ == layer
    assert_prompt_logprobs_match(llm, model, [random_prompt(n, spec.vocab_size, 400 + n) for n in (5, 23)], 0.2)


# ---- random weights of a pre-quantized configuration (load_format='dummy': what a speed benchmark runs) ------------

@pytest.mark.parametrize("spec_name, quantization_config, layer", [
    ("llama3_gqa", {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True},
     "Int4WeightOnlyLinear"),
    ("qwen2_bias_tied", {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
     "Int4WeightOnlyLinear"),  # q/k/v biases: drawn as floats, not left as allocated
    ("llama3_gqa", {"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": True}, "Int8WeightOnlyLinear"),
    ("llama3_gqa", {"quant_method": "gptq", "bits": 8, "group_size": 128, "sym": False}, "Uint8GroupedLinear")])
def test_random_weights_of_a_prequantized_configuration_run_as_its_layers(tmp_path, spec_name, quantization_config,
                                                                          layer):
    """A directory with a GPTQ / AWQ quantization_config and no weights, run with load_format='dummy': random codes
    through the layers the checkpoint would run as (not re-quantized floats), generating finite logprobs."""
    from fasterllm import SamplingParams

    spec = next(s for s in TINY_SPECS if s.name == spec_name)
    build_tiny_model(spec, tmp_path, **WIDE)
    for weights in tmp_path.glob("*.safetensors"):
        weights.unlink()
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    llm = LLM(str(tmp_path), load_format="dummy", device="cpu", num_kv_blocks=64)
    model = llm.engine.executor.runner.model
    assert {type(model.layers[0].qkv_proj).__name__, type(model.layers[1].down_proj).__name__} == {layer}
    bias = model.layers[0].qkv_proj.bias
    assert bias is None or 0.01 < bias.float().std().item() < 0.03  # the float draw, N(0, 0.02)
    down = model.layers[1].down_proj  # its weight, read back through the layer: spread about as a float model's
    inputs = torch.eye(WIDE["intermediate_size"], dtype=model.embed_tokens.weight.dtype)
    weight = down(inputs).float()
    assert weight.shape == (WIDE["intermediate_size"], WIDE["hidden_size"]) and torch.isfinite(weight).all()
    assert 0.01 < weight.std().item() < 0.03 and abs(weight.mean().item()) < 0.005
    assert type(model.lm_head).__name__ != layer  # the head runs float, as such checkpoints store it
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    output = llm.generate([{"prompt_token_ids": random_prompt(9, spec.vocab_size, 7)}], params, use_tqdm=False)[0]
    token_logprobs = [step[token].logprob for step, token in zip(output.outputs[0].logprobs,
                                                                 output.outputs[0].token_ids)]
    assert len(token_logprobs) == 6 and all(np.isfinite(token_logprobs))


def test_a_group_size_that_does_not_divide_a_projection_is_an_error_naming_both(tmp_path):
    spec = next(s for s in TINY_SPECS if s.name == "llama3_gqa")
    build_tiny_model(spec, tmp_path)  # hidden 64: q/k/v take 64 inputs
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPTQ checkpoint of group_size=128 cannot hold a projection of 64 inputs"):
        LLM(str(tmp_path), load_format="dummy", device="cpu", num_kv_blocks=16)
