#!/usr/bin/env bash
# One-shot GPU check (see benchmarks/gpu_check.py): install, the CUDA-relevant tests, the checks.
# On a machine without CUDA the tests and the checks run their CPU parts (the kernel interpreted).
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no NVIDIA GPU: CPU parts only"
make versions  # the lock, in .venv (VENV=path for another)
py="${VENV:-.venv}/bin/python"
if command -v nvidia-smi > /dev/null; then  # the peers timed against (best effort: skipped if missing)
  "$py" -m pip install --quiet liger-kernel || echo "liger-kernel not installed"
  "$py" -m pip install --quiet --no-deps 'cut-cross-entropy>=25.1' || echo "cut-cross-entropy not installed"
fi
"$py" -m pytest -q tests/test_fused_loss.py tests/test_fused_dtypes.py tests/test_varlen.py tests/test_packing.py \
  tests/test_qlora.py tests/test_strategy.py tests/test_bf16.py tests/test_lora_variants.py tests/test_base_to_chat.py
"$py" benchmarks/gpu_check.py
