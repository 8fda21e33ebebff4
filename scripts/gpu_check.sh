#!/usr/bin/env bash
# GPU validation for megatron-mm-balance: cost-model calibration on real kernels and
# the overlapped exchange on a dedicated CUDA stream. Installs nothing: it expects a
# stock CUDA + PyTorch (+ numpy) image and says what it skips. Results go to $OUT
# when set, else ./gpu_results/. See docs/gpu.md.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="${here}${PYTHONPATH:+:${PYTHONPATH}}"
export PYTHONUNBUFFERED=1
out="${OUT:-./gpu_results}"
exec timeout --signal=TERM 480 python3 "${here}/scripts/gpu_check.py" --out "${out}" "$@"
