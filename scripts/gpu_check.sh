#!/usr/bin/env bash
# GPU validation for megatron-mm-balance (docs/gpu.md): each part that can run here, in its
# own process under its own timeout, then one screen saying which part passed. One GPU:
# cost-model calibration; the runtime at 2 ranks sharing the GPU (CUDA delivery, checksums on
# the compute stream, the sync debug mode, the pinned pool and host allocator flat); the same
# under the stream sanitizer; the overlap at world 1; the timing hooks; Megatron-LM's loop
# (MEGATRON_LM_DIR, transformer-engine). Two or more: Megatron-LM off vs on; Megatron-Bridge's
# Qwen3-VL toy (TP=2, PP=2, CP=2 x DP=2, images mode over NCCL, against a control band, one
# process per GPU); Bridge's CP=2 frame split. Installs nothing. Results in $OUT (default
# ./gpu_results/).
#
#   bash scripts/gpu_check.sh            the parts that run here
#   bash scripts/gpu_check.sh --cpu      parts 1, 2, 4, 5 on the CPU (what the test suite runs)
#   bash scripts/gpu_check.sh --dry-run  every part, what it checks, run here or why not; runs
#                                        nothing (GPU_COUNT=N: plan for N GPUs)
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="${here}${PYTHONPATH:+:${PYTHONPATH}}"
export PYTHONUNBUFFERED=1
out="${OUT:-./gpu_results}"
dry=0
cpu=()
for a in "$@"; do
  case "$a" in
    --dry-run) dry=1 ;;
    --cpu) cpu=(--cpu) ;;
    *) echo "gpu_check.sh: unknown argument $a (--cpu, --dry-run)" >&2; exit 2 ;;
  esac
done
gpus=${GPU_COUNT:-$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)}
check=(python3 "${here}/scripts/gpu_check.py" --out "${out}")

if [ $dry = 1 ]; then
  exec "${check[@]}" --list --gpus "${gpus}" "${cpu[@]}"
fi
mkdir -p "${out}/parts"
rm -f "${out}"/parts/*.json
while read -r key limit; do
  start=$(date +%s)
  rc=0
  timeout --signal=TERM --kill-after=10 "${limit}" "${check[@]}" --part "${key}" "${cpu[@]}" || rc=$?
  if [ ! -f "${out}/parts/${key}.json" ]; then         # killed or crashed before its verdict
    why="exit ${rc}"; [ $rc = 124 ] && why="timed out after ${limit} s"
    printf '{"status": "FAIL", "line": "%s after %s s (no result written)"}\n' "${why}" \
      "$(( $(date +%s) - start ))" > "${out}/parts/${key}.json"
  fi
done < <("${check[@]}" --plan --gpus "${gpus}" "${cpu[@]}")
echo
exec "${check[@]}" --summary
