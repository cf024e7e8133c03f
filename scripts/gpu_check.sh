#!/usr/bin/env bash
# The GPU check of the memory model in one command (issue #15; README "GPU check"). On a lent H200, first build the
# kit here (python -m devkit.gpu.kit), then call the device tool once:
#   run(command="bash scripts/gpu_check.sh", carry=[".gpukit"], timeout_s=600)
# It installs the carried wheels, runs every step under a 450 s deadline (devkit/gpu/check.py) and leaves in $OUT:
# results.jsonl, estimator_gpu.md, runs.tar, calibration.json, gpu_check.log, nvidia-smi.txt. Here, every step at
# toy sizes on the CPU:
#   bash scripts/gpu_check.sh --cpu-smoke [--out DIR]
# Other options go to `python -m devkit.gpu.check run` (--deadline S, --only probe,published,points,train,context,calibrate).
set -uo pipefail
cd "$(dirname "$0")/.."
export GPU_CHECK_T0=${GPU_CHECK_T0:-$(date +%s)}
SMOKE=0
OUT_DIR=${OUT:-runs/gpu_check}
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-smoke) SMOKE=1 ;;
    --out) OUT_DIR=$2; shift ;;
    *) EXTRA+=("$1") ;;
  esac
  shift
done
mkdir -p "$OUT_DIR"
export WANDB_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export TQDM_DISABLE=1 HF_DATASETS_DISABLE_PROGRESS_BARS=1
# what `train` sets before CUDA starts (lowmem_ft/train/resilience/guard.py): the harness points measure the same allocator
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export LOWMEM_FT_CACHE=${LOWMEM_FT_CACHE:-${TMPDIR:-/tmp}/lowmem-ft-cache}
if [ "$SMOKE" = 1 ]; then
  PY=python3
  [ -x .venv/bin/python ] && PY=.venv/bin/python
  MODE=(--cpu-smoke)
else
  PY=${PYTHON:-python3}
  if [ ! -f .gpukit/manifest.json ]; then
    echo "gpu_check: no .gpukit here; run 'python -m devkit.gpu.kit' before the call and carry .gpukit" >&2
    exit 2
  fi
  SITE=${TMPDIR:-/tmp}/lowmem-gpukit
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .gpukit/wheels/*.whl \
    || { echo "gpu_check: installing the carried wheels failed" >&2; exit 2; }
  export PYTHONPATH="$SITE:$PWD"
  MODE=()
  nvidia-smi >"$OUT_DIR/nvidia-smi.txt" 2>&1 || true
fi
echo "gpu_check: $("$PY" -V 2>&1), output in $OUT_DIR, $(( $(date +%s) - GPU_CHECK_T0 )) s spent on set-up"
"$PY" -m devkit.gpu.check run --out "$OUT_DIR" "${MODE[@]}" "${EXTRA[@]}" 2>&1 | tee -a "$OUT_DIR/gpu_check.log"
exit "${PIPESTATUS[0]}"
