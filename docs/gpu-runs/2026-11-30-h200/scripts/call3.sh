#!/bin/bash
# Third device call: where the training step synchronizes (12 steps of fsdp-compile under
# torch.cuda.set_sync_debug_mode, counted by knapray stack), then the sampling section.
set -o pipefail
exec > >(tee $OUT/call3.log) 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
SYNC_SITES_ARM=1 SYNC_SITES_OUT=$OUT/syncs.txt PYTHONPATH=$PWD/.gpucall/syncdbg PYTHONUNBUFFERED=1 \
  timeout 110 python3 -m knapray.commands.gpu_check --only fsdp-compile --steps 12 --timeout 100 2>&1 | grep -v "synchroniz" | tail -25
echo "== sampling"
PYTHON=python3 GPU_WHEELS=.whla GPU_BENCH_JSON=$OUT/sampling.json GPU_BENCH_TIMEOUT=250 \
  GPU_BENCH_FLAGS='--skip gradients --skip runs --skip fp8' timeout ${SAMPLING_S:-300} make gpu-bench
echo "call3 done"
