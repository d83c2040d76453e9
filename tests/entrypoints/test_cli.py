"""The `fasterllm` command as a user runs it."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "fasterllm.entrypoints.cli"]
SMALL = ["--cpu-kv-cache-gib", "0.1", "--max-model-len", "512"]


def run(args, stdin=None, timeout=300):
    return subprocess.run(CLI + args, input=stdin, capture_output=True, text=True, timeout=timeout)


def test_generate_with_the_default_model_answers():
    result = run(["generate", "What is the capital of France?", *SMALL])
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_generate_with_an_fp8_kv_cache_answers():
    # a plain prompt: through the chat template SmolLM2-135M's bf16 answer changes with an fp8 cache (README)
    result = run(["generate", "--no-chat-template", "The capital of France is", *SMALL, "--kv-cache-dtype", "fp8",
                  "--max-tokens", "8"])
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_models_lists_every_architecture_the_loader_accepts():
    from fasterllm.config import DECODER_ARCHITECTURES, ENCODER_DECODER_ARCHITECTURES

    result = run(["models"])
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert set(DECODER_ARCHITECTURES) | set(ENCODER_DECODER_ARCHITECTURES) <= set(rows)
    assert " yes " in rows["LlamaForCausalLM"]
    assert "gguf (Q4_0/Q4_1/Q4_K/Q5_K/Q6_K/Q8_0 blocks)" in rows["LlamaForCausalLM"]
    assert "encoder-decoder" in rows["T5ForConditionalGeneration"]
    assert "mixture of experts" in rows["MixtralForCausalLM"] and "fused MoE" in rows["MixtralForCausalLM"]
    deepseek = rows["DeepseekV2ForCausalLM"].split()
    assert deepseek[1] == "models/deepseek_v2.py" and deepseek[-4:-2] == ["no", "no"]  # no GGUF, no tensor parallel


def test_chat_streams_replies_and_keeps_the_conversation():
    result = run(["chat", "--temperature", "0", *SMALL],
                 stdin="What is the capital of France?\nAnd what is the capital of Italy?\n\n")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout and "Rome" in result.stdout


def test_generate_follows_a_choice_and_a_json_schema(tmp_path):
    result = run(["generate", "Is Paris in France?", "--choice", "yes", "--choice", "no", *SMALL])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() in ("yes", "no")
    schema = tmp_path / "city.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                                  "required": ["city"], "additionalProperties": False}))
    result = run(["generate", "Name a city, as JSON.", "--json-schema", str(schema), "--temperature", "0", *SMALL])
    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout)) == {"city"}


def test_generate_with_an_encoder_decoder_model_prints_the_offline_output(tiny_seq2seq):
    from fasterllm import LLM, SamplingParams

    directory = str(tiny_seq2seq["marian"][0])
    result = run(["generate", "--model", directory, "--max-tokens", "8", "--temperature", "0", "--dtype", "float32",
                  "w5 w9 w11 w3"])
    assert result.returncode == 0, result.stderr
    (expected,) = LLM(directory, dtype="float32", device="cpu", num_kv_blocks=32).generate(
        "w5 w9 w11 w3", SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert result.stdout.strip() == expected.outputs[0].text.strip() and expected.outputs[0].text


def test_bench_runs_ours_and_transformers_and_prints_the_ratio(tmp_path):
    # a tiny random Llama: transformers would take ~15 s to read the default GGUF, and the bench is what is tested
    sys.path.insert(0, str(Path(__file__).parents[1] / "parity"))
    from parity_utils import TINY_SPECS, build_tiny_model

    build_tiny_model(TINY_SPECS[0], tmp_path)
    result = run(["bench", "--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--repeats", "1",
                  "--dtype", "float32", "--model", str(tmp_path), "--cpu-kv-cache-gib", "0.1"])
    assert result.returncode == 0, result.stderr
    assert "fasterllm     :" in result.stdout and "transformers  :" in result.stdout
    assert "ratio (output tok/s, fasterllm / transformers):" in result.stdout


def test_bench_final_only_takes_latencies_from_the_requests_timestamps(tmp_path):
    sys.path.insert(0, str(Path(__file__).parents[1] / "parity"))
    from parity_utils import TINY_SPECS, build_tiny_model

    build_tiny_model(TINY_SPECS[0], tmp_path)
    common = ["bench", "--num-prompts", "3", "--input-len", "8", "--output-len", "6", "--repeats", "1", "--no-hf",
              "--dtype", "float32", "--model", str(tmp_path), "--cpu-kv-cache-gib", "0.1", "--final-only"]
    result = run(common)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("fasterllm     :"))
    tpot = float(line.split("TPOT median ")[1].split(" ms")[0])
    assert tpot > 0 and "ITL p50/p99/max nan/nan/nan" in line
    refused = run([*common, "--long-prompt-len", "16"])
    assert refused.returncode == 2 and "drop --final-only or --long-prompt-len" in refused.stderr


@pytest.mark.parametrize("args, message", [
    (["generate", "--model", "/no/such/model", "hi"], "error: Model '/no/such/model' is neither an existing path"),
    (["generate", "--temperature", "-1", "hi"], "error: temperature=-1.0 is out of range"),
    (["generate", "--max-model-len", "100000", "hi"], "error: max_model_len=100000 exceeds"),
    (["bench", "--input-len", "0", *SMALL], "error: num_prompts=32, input_len=0, output_len=128, repeats=3 must all be >= 1"),
    (["embed", "--quantization", "int8", "hi"], "error: quantization='int8' is not supported for all-MiniLM-L6-v2"),
    (["serve", "--load-format", "dummy", *SMALL, "--embedding-model", "default", "--embedding-quantization", "int4"],
     "error: quantization='int4' is not supported for all-MiniLM-L6-v2"),
    (["serve", "--embedding-quantization", "int8"], "error: embedding_quantization='int8' has no model to quantize"),
    (["generate", "--regex", "(unclosed", "hi", *SMALL], "error: prompt 0: structured_outputs.regex could not be "
     "compiled"),
    (["generate", "--json-schema", "/no/such/schema.json", "hi"], "error: [Errno 2] No such file or directory"),
])
def test_bad_arguments_print_one_clear_line_not_a_traceback(args, message):
    result = run(args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
