#!/usr/bin/env bash
# Start a private local Ray head, submit the demo training as a Ray job, wait, stop that head.
# What a user does on a real cluster is the same `ray job submit` against its head.
#   bash jobs/submit_demo.sh [extra jobs/train.py args, e.g. --set run.max_steps=8]
#   bash jobs/submit_demo.sh --head-only    # start the head, wait until it takes jobs, stop it
# The head gets free ports and its own temp dir, so a Ray already running on this machine
# is left alone; only the head started here is stopped at the end. If the head does not
# take jobs within KNAPRAY_HEAD_TIMEOUT_S seconds (default 120), or exits, nothing is
# submitted and the script fails with the head's last log lines.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV_BIN="$(pwd)/.venv/bin"
export PATH="$VENV_BIN:$PATH"
export RAY_AUTH_MODE=token                   # Ray 2.60 enables token auth: the CLI needs this
export RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=0.2

free_port() { python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
GCS_PORT=$(free_port); DASH_PORT=$(free_port)
RAY_TMP=$(mktemp -d /tmp/knapray-ray-XXXXXX)
[ "${1:-}" = "--head-only" ] || [ -f datasets/generated/demo/schema.json ] \
    || python -m knapray.commands.synthetic --demo --quiet --out datasets/generated/demo

# --block keeps `ray start` in the foreground; stopping it (its own process group) stops
# exactly the processes it started.
setsid ray start --head --block --port "$GCS_PORT" --dashboard-port "$DASH_PORT" --include-dashboard=true \
    --num-cpus 4 --temp-dir "$RAY_TMP" --disable-usage-stats >"$RAY_TMP/head.log" 2>&1 &
HEAD_PID=$!
# A head stopped in the middle of its start can take a minute to act on TERM: after 10 s
# the group is killed.
cleanup() {
    kill -TERM -- "-$HEAD_PID" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$HEAD_PID" 2>/dev/null || break; sleep 0.2; done
    kill -KILL -- "-$HEAD_PID" 2>/dev/null || true
    wait "$HEAD_PID" 2>/dev/null || true
}
trap cleanup EXIT
# Ready when the jobs API answers the same client that submits (the Ray CLI, which sends
# the auth token itself): a bare HTTP poll gets 401 under token auth and never succeeds.
HEAD_TIMEOUT_S=${KNAPRAY_HEAD_TIMEOUT_S:-120}
deadline=$((SECONDS + HEAD_TIMEOUT_S))
until timeout 15 ray job list --address "http://127.0.0.1:$DASH_PORT" >"$RAY_TMP/ready.log" 2>&1; do
    if ! kill -0 "$HEAD_PID" 2>/dev/null; then
        echo "[submit_demo] error: the Ray head exited before its jobs API answered; its log ($RAY_TMP/head.log) ends:" >&2
        tail -n 20 "$RAY_TMP/head.log" >&2
        exit 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
        echo "[submit_demo] error: the Ray head's jobs API (port $DASH_PORT) did not answer within ${HEAD_TIMEOUT_S}s" \
             "(KNAPRAY_HEAD_TIMEOUT_S); nothing submitted; the head's log: $RAY_TMP/head.log. Last answer:" >&2
        tail -n 5 "$RAY_TMP/ready.log" >&2
        exit 1
    fi
    sleep 1
done
echo "[submit_demo] private Ray head on ports $GCS_PORT (GCS) / $DASH_PORT (jobs) takes jobs after ${SECONDS}s"
if [ "${1:-}" = "--head-only" ]; then
    exit 0
fi
echo "[submit_demo] submitting the job"
# --working-dir ships the checkout (Ray leaves out what .gitignore lists: .venv, runs/,
# datasets/generated/), so the corpus is given as an absolute path every node can read,
# and the run directory goes to absolute storage outside Ray's upload folder.
ray job submit --address "http://127.0.0.1:$DASH_PORT" --working-dir . -- \
    python jobs/train.py --config jobs/configs/demo.yaml \
    --set "data.corpus=$(pwd)/datasets/generated/demo" --set run.storage=/tmp/knapray-job-runs \
    --set "run.name=job-$(date +%Y%m%d-%H%M%S)" "$@"
echo "[submit_demo] job finished"
