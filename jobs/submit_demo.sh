#!/usr/bin/env bash
# Start a local Ray head, submit the demo training as a Ray job, wait for it, stop Ray.
# What a user does on a real cluster is the same `ray job submit` against its head.
#   bash jobs/submit_demo.sh [extra jobs/train.py args, e.g. --set run.max_steps=8]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV_BIN="$(pwd)/.venv/bin"
export PATH="$VENV_BIN:$PATH"
export RAY_AUTH_MODE=token                   # Ray 2.60 enables token auth by default
export RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=0.2
trap 'ray stop --force >/dev/null 2>&1 || true' EXIT
ray stop --force >/dev/null 2>&1 || true
ray start --head --num-cpus 4 --include-dashboard=true --disable-usage-stats >/dev/null
echo "[submit_demo] Ray head started; submitting the job"
# --working-dir ships the checkout (Ray leaves out what .gitignore lists: .venv, runs/, ...).
ray job submit --working-dir . -- python jobs/train.py --config jobs/configs/demo.yaml \
    --set run.storage=/tmp/knapray-job-runs "$@"
echo "[submit_demo] job finished"
