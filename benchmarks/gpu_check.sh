#!/usr/bin/env bash
# One-shot GPU check (see benchmarks/gpu_check.py): install, the CUDA-relevant tests, the checks.
# On a machine without CUDA the tests and the checks run their CPU parts (the kernel interpreted).
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no NVIDIA GPU: CPU parts only"
make install
python -m pytest -q tests/test_fused_loss.py tests/test_fused_dtypes.py tests/test_packing.py tests/test_qlora.py
python benchmarks/gpu_check.py
