#!/usr/bin/env bash
# GPU validation for megatron-mm-balance: cost-model calibration on real kernels, the
# overlapped exchange on a dedicated CUDA stream, the per-pack timing hooks and the online
# cost fit (one GPU); with two or more visible GPUs and a patched Megatron-LM checkout in
# MEGATRON_LM_DIR, also Megatron-LM's own iteration time with --mm-balance off vs on
# (mm-balance bench-realpath: NCCL, transformer-engine). Installs nothing: it expects a stock
# CUDA + PyTorch (+ numpy) image and says what it skips. Results go to $OUT when set, else
# ./gpu_results/. See docs/gpu.md.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="${here}${PYTHONPATH:+:${PYTHONPATH}}"
export PYTHONUNBUFFERED=1
out="${OUT:-./gpu_results}"
timeout --signal=TERM 480 python3 "${here}/scripts/gpu_check.py" --out "${out}" "$@"
case " $* " in *" --cpu "*) exit 0 ;; esac
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
# -- Bridge Qwen3-VL, context parallel 2 (vision_dp_when_cp): frames split by count vs by cost
#    (mm_balance.cp_split), the losses of the two runs compared; self-contained section.
if [ "${gpus}" -ge 2 ] && [ -n "${MEGATRON_BRIDGE_DIR:-}" ] && [ -n "${DATA_PATH:-}" ]; then
  echo "== 5. Bridge Qwen3-VL CP=2 frame split, count vs cost (2 GPUs, launcher runs)"
  timeout --signal=TERM 1900 python3 "${here}/scripts/gpu_check.py" --bridge-cp-split --out "${out}" --gpus 2 \
    || echo "== 5. Bridge CP=2 frame split: FAILED (see ${out}/bridge-cp2-*.log)"
else
  echo "== 5. Bridge CP=2 frame split: skipped (needs 2 GPUs, MEGATRON_BRIDGE_DIR (patched) and DATA_PATH; PYTHON: Bridge's Python 3.12)"
fi
if [ "${gpus}" -lt 2 ]; then
  echo "== 4. off/on in Megatron-LM's own loop: skipped (${gpus} GPU visible; needs 2)"
  exit 0
fi
if [ -z "${MEGATRON_LM_DIR:-}" ]; then
  echo "== 4. off/on in Megatron-LM's own loop: skipped (set MEGATRON_LM_DIR to a checkout with scripts/apply_patches.sh applied)"
  exit 0
fi
echo "== 4. off/on in Megatron-LM's own loop: mm-balance bench-realpath on 2 GPUs (NCCL, transformer-engine)"
exec timeout --signal=TERM 1500 python3 -m megatron_mm_balance.cli bench-realpath \
  --megatron-lm "${MEGATRON_LM_DIR}" --out "${out}/bench-realpath" --rounds "${ROUNDS:-1}" --iters 6 \
  --json "${out}/bench_realpath.json" --set GPUS_PER_NODE=2
