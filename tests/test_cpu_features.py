"""CPU kernel choices follow what the CPU supports: on an AVX2-only CPU (no oneDNN bf16) bf16 runs unpacked
instead of crashing, the default dtype is fp32, and the quantized paths it changes (int4 in bf16, W8A8 with or without
an exact int8 GEMM) load and answer.

One test runs a real AVX2-only process (torch, oneDNN and MKL capped to AVX2 by AVX2_ONLY_ENV) whatever CPU runs
the suite; the others force the AVX2-only answer in this process."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fasterllm import cpu_features as cpu_features_module
from fasterllm.config import EngineArgs
from fasterllm.cpu_features import AVX2_ONLY_ENV, CPUFeatures, bf16_path_note, cpu_features
from fasterllm.layers.linear import PackedCPULinear, can_pack
from fasterllm.layers.quantization.int8 import quantize_int8_per_channel
from fasterllm.layers.quantization.w8a8 import W8A8Linear, quantize_per_token

AVX2_ONLY = CPUFeatures(kernel_isa="AVX2", onednn_bf16=False, bf16_dot_product=False, exact_int8_matmul=False)
CPU = torch.device("cpu")

AVX2_PROCESS = r"""
import json, logging, sys
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from fasterllm import LLM, SamplingParams
from fasterllm.cpu_features import cpu_features
features = cpu_features()
answers = {"kernel_isa": features.kernel_isa, "onednn_bf16": features.onednn_bf16, "native_bf16": features.native_bf16,
           "exact_int8_matmul": features.exact_int8_matmul}
import torch  # a larger product than the start-up check's, of the rows that saturate where the GEMM does
a, b = torch.full((4, 256), 127, dtype=torch.int8), torch.full((256, 16), -127, dtype=torch.int8)
answers["probe_exact"] = bool((torch._int_mm(a, b) == -256 * 127 * 127).all())
for dtype, method in (("bfloat16", None), ("auto", None), ("bfloat16", "int4"), ("auto", "w8a8")):
    llm = LLM(sys.argv[1], dtype=dtype, quantization=method, max_model_len=256, num_kv_blocks=32)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    answers[f"{dtype} {method}"] = [str(llm.engine.dtype), out[0].outputs[0].text]
print(json.dumps(answers))
"""


@pytest.fixture
def avx2_only(monkeypatch):
    monkeypatch.setattr(cpu_features_module, "_detected", AVX2_ONLY)


def test_an_avx2_only_process_runs_bf16_int4_and_w8a8(gguf):
    env = {**os.environ, **AVX2_ONLY_ENV}
    done = subprocess.run([sys.executable, "-c", AVX2_PROCESS, str(gguf)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    assert answers["kernel_isa"] == "AVX2" and not answers["onednn_bf16"] and not answers["native_bf16"]
    # oneDNN's AVX2 int8 GEMM saturated on an AVX-512 machine capped to AVX2 and summed exactly on a Zen 3 AVX2-only
    # one: whichever it does here, the start-up answer must say so (W8A8 uses the GEMM only where it is exact)
    assert answers["exact_int8_matmul"] == answers["probe_exact"]
    assert answers["bfloat16 None"][0] == "torch.bfloat16" and answers["auto None"][0] == "torch.float32"
    for run in ("bfloat16 None", "auto None", "bfloat16 int4", "auto w8a8"):
        assert "Paris" in answers[run][1], (run, answers[run])
    # the user hears once per engine asked for bf16 how it runs here, and no traceback
    assert done.stderr.count("without oneDNN bf16 kernels") == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr


def test_without_onednn_bf16_only_fp32_is_packed_and_auto_is_fp32(avx2_only):
    assert can_pack(CPU, torch.float32) and not can_pack(CPU, torch.bfloat16)
    assert EngineArgs().resolve_dtype(CPU) == torch.float32
    assert "linear weights stay unpacked" in bf16_path_note(torch.bfloat16)
    assert bf16_path_note(torch.float32) is None


def test_an_unpacked_bf16_linear_gives_the_packed_ones_numbers():
    if not cpu_features().onednn_bf16:
        pytest.skip(f"no oneDNN bf16 kernels on this CPU to compare with ({cpu_features().describe()})")
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96, bias=True).to(torch.bfloat16)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    packed = PackedCPULinear(linear.weight, linear.bias)(x)
    # both sum in fp32 and round once to bf16: at most a bf16 step apart
    torch.testing.assert_close(F.linear(x, linear.weight, linear.bias).float(), packed.float(), rtol=2 ** -7, atol=1e-3)



def test_w8a8_without_an_exact_int8_matmul_gives_the_integer_sums_numbers(monkeypatch):
    torch.manual_seed(0)
    weight, x = torch.randn(96, 576) * 0.05, torch.randn(7, 576)
    x[0] = x[0].abs()  # rows of one sign and many large codes: where a saturating int8 GEMM goes wrong
    exact = None
    if cpu_features().exact_int8_matmul:
        exact = W8A8Linear.from_float(weight, None)(x)
    monkeypatch.setattr(cpu_features_module, "_detected", AVX2_ONLY)
    layer = W8A8Linear.from_float(weight, None)
    assert layer.qweight is None  # the fp32 path was chosen
    got = layer(x)
    codes, w_scales = quantize_int8_per_channel(weight)
    qx, x_scales = quantize_per_token(x)
    sums = (qx.double() @ codes.double().t()).float()
    torch.testing.assert_close(got, sums * x_scales * w_scales[None, :], rtol=0, atol=0)
    if exact is not None:
        torch.testing.assert_close(got, exact, rtol=0, atol=0)
