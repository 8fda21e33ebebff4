#!/usr/bin/env bash
# GPU validation for megatron-mm-balance: cost-model calibration on real kernels, the
# overlapped exchange on a dedicated CUDA stream, the per-pack timing hooks and the online
# cost fit (one GPU); with two or more visible GPUs and a patched Megatron-LM checkout in
# MEGATRON_LM_DIR, also Megatron-LM's own iteration time with --mm-balance off vs on
# (mm-balance bench-realpath: NCCL, transformer-engine); with a patched Megatron-Bridge 0.6.x
# (MEGATRON_BRIDGE_DIR, or installed for PYTHON), the Bridge Qwen3-VL toy through
# scripts/pretrain_bridge_vlm.sh: one GPU, the balanced run with its timings; two or more,
# off vs on (NCCL, transformer-engine). Installs nothing: it expects a stock CUDA + PyTorch
# (+ numpy) image and says what it skips. Results go to $OUT when set, else ./gpu_results/.
# See docs/gpu.md.
#
#   bash scripts/gpu_check.sh            all parts
#   bash scripts/gpu_check.sh --cpu      parts 1-3 on the CPU (what the test suite runs)
#   bash scripts/gpu_check.sh --dry-run  print what each part would run here, run nothing
#                                        (GPU_COUNT=N: plan for N GPUs instead of the visible ones)
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="${here}${PYTHONPATH:+:${PYTHONPATH}}"
export PYTHONUNBUFFERED=1
out="${OUT:-./gpu_results}"
dry=0
case " $* " in *" --dry-run "*) dry=1 ;; esac
gpus=${GPU_COUNT:-$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)}

if [ $dry = 1 ]; then
  echo "== 1-3. python3 ${here}/scripts/gpu_check.py --out ${out} (timeout 480 s; ${gpus} GPU(s): $([ "${gpus}" -ge 1 ] && echo 'the GPU configuration' || echo 'the CPU configuration'))"
else
  timeout --signal=TERM 480 python3 "${here}/scripts/gpu_check.py" --out "${out}" "$@"
  case " $* " in *" --cpu "*) exit 0 ;; esac
fi

rc=0
# part 4: Megatron-LM's own loop, off vs on (2 GPUs)
if [ "${gpus}" -lt 2 ]; then
  echo "== 4. off/on in Megatron-LM's own loop: skipped (${gpus} GPU visible; needs 2)"
elif [ -z "${MEGATRON_LM_DIR:-}" ]; then
  echo "== 4. off/on in Megatron-LM's own loop: skipped (set MEGATRON_LM_DIR to a checkout with scripts/apply_patches.sh applied)"
else
  part4=(python3 -m megatron_mm_balance.cli bench-realpath --megatron-lm "${MEGATRON_LM_DIR}"
         --out "${out}/bench-realpath" --rounds "${ROUNDS:-1}" --iters 6
         --json "${out}/bench_realpath.json" --set GPUS_PER_NODE=2)
  echo "== 4. off/on in Megatron-LM's own loop: mm-balance bench-realpath on 2 GPUs (NCCL, transformer-engine)"
  if [ $dry = 1 ]; then echo "  timeout 1500 ${part4[*]}"
  else timeout --signal=TERM 1500 "${part4[@]}" || rc=$?; fi
fi

# part 5: Megatron-Bridge's Qwen3-VL toy (1 GPU: the run and its timings; 2+: off vs on)
part5=(python3 "${here}/scripts/gpu_check.py" --out "${out}" --bridge-ranks "${gpus}")
if [ "${gpus}" -lt 1 ]; then
  echo "== 5. Megatron-Bridge Qwen3-VL toy: skipped (no GPU visible; scripts/gpu_check.py --bridge-only --bridge-ranks 2 runs it through the CPU harness)"
elif [ $dry = 1 ]; then
  echo "== 5. Megatron-Bridge Qwen3-VL toy: timeout 2000 ${part5[*]} --bridge-only; its launcher runs:"
  "${part5[@]}" --bridge-plan
else
  timeout --signal=TERM 2000 "${part5[@]}" --bridge-only || rc=$?
fi
# part 6: Bridge Qwen3-VL, context parallel 2 (vision_dp_when_cp): frames split by count vs by
# cost (mm_balance.cp_split), the losses of the two runs compared (2 GPUs)
part6=(python3 "${here}/scripts/gpu_check.py" --bridge-cp-split --out "${out}" --gpus 2)
if [ "${gpus}" -lt 2 ] || [ -z "${MEGATRON_BRIDGE_DIR:-}" ] || [ -z "${DATA_PATH:-}" ]; then
  echo "== 6. Bridge CP=2 frame split: skipped (needs 2 GPUs, MEGATRON_BRIDGE_DIR (patched) and DATA_PATH; PYTHON: Bridge's Python 3.12)"
elif [ $dry = 1 ]; then
  echo "== 6. Bridge Qwen3-VL CP=2 frame split, count vs cost: timeout 1900 ${part6[*]}"
else
  echo "== 6. Bridge Qwen3-VL CP=2 frame split, count vs cost (2 GPUs, launcher runs)"
  timeout --signal=TERM 1900 "${part6[@]}" || { rc=$?; echo "== 6. Bridge CP=2 frame split: FAILED (see ${out}/bridge-cp2-*.log)"; }
fi
exit $rc
