#!/usr/bin/env bash
# Start a private local Ray head, submit the demo training as a Ray job, wait, stop that head.
# What a user does on a real cluster is the same `ray job submit` against its head.
#   bash jobs/submit_demo.sh [extra jobs/train.py args, e.g. --set run.max_steps=8]
#   bash jobs/submit_demo.sh --head-only    # start the head, submit a no-op job to it, stop it
# The head gets a free port for every server it starts (GCS, dashboard, its agent's HTTP and
# gRPC ports, runtime-env agent, metrics, node and object managers, Ray client) and its own
# temp dir, and listens on 127.0.0.1 only, so a Ray already running on this machine is left
# alone (Ray's defaults collide with it: the agent's 52365 held by another Ray made the head
# refuse jobs with "No available agent to submit job"); only the head started here is
# stopped at the end. It takes jobs once its jobs API answers and its dashboard agent has
# registered on the port given here. If that does not happen within KNAPRAY_HEAD_TIMEOUT_S
# seconds (default 120), or the head exits, nothing is submitted and the script fails with
# the head's last log lines.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV_BIN="$(pwd)/.venv/bin"
export PATH="$VENV_BIN:$PATH"
export RAY_AUTH_MODE=token                   # Ray 2.60 enables token auth: the CLI needs this
export RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=0.2

# Nine distinct free ports, all held until every one is chosen.
read -r GCS_PORT DASH_PORT AGENT_PORT AGENT_GRPC_PORT RUNTIME_ENV_PORT METRICS_PORT NODE_MANAGER_PORT \
    OBJECT_MANAGER_PORT CLIENT_PORT < <(python -c '
import socket
held = [socket.socket() for _ in range(9)]
for s in held:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in held))')
RAY_TMP=$(mktemp -d /tmp/knapray-ray-XXXXXX)
[ "${1:-}" = "--head-only" ] || [ -f datasets/generated/demo/schema.json ] \
    || python -m knapray.commands.synthetic --demo --quiet --out datasets/generated/demo

# --block keeps `ray start` in the foreground; stopping it (its own process group) stops
# exactly the processes it started. RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 gives the node the
# address 127.0.0.1, which binds every server of the head to the loopback interface.
# RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0: on SIGTERM the head stops at once; Ray's default
# first drains the node for up to 30 s (for Serve proxies still routing to it: there are none
# here), so every run of this script waited out the 10 s below and killed it.
RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 setsid ray start --head --block --port "$GCS_PORT" --dashboard-port "$DASH_PORT" \
    --include-dashboard=true --dashboard-agent-listen-port "$AGENT_PORT" --dashboard-agent-grpc-port "$AGENT_GRPC_PORT" \
    --runtime-env-agent-port "$RUNTIME_ENV_PORT" --metrics-export-port "$METRICS_PORT" \
    --node-manager-port "$NODE_MANAGER_PORT" --object-manager-port "$OBJECT_MANAGER_PORT" \
    --ray-client-server-port "$CLIENT_PORT" \
    --num-cpus 4 --temp-dir "$RAY_TMP" --disable-usage-stats >"$RAY_TMP/head.log" 2>&1 &
HEAD_PID=$!
# A head stopped in the middle of its start can take a minute to act on TERM: after 10 s
# the group is killed.
cleanup() {
    kill -TERM -- "-$HEAD_PID" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$HEAD_PID" 2>/dev/null || break; sleep 0.2; done
    if kill -0 "$HEAD_PID" 2>/dev/null; then
        echo "[submit_demo] the Ray head did not stop within 10 s of SIGTERM; killing it" >&2
    fi
    kill -KILL -- "-$HEAD_PID" 2>/dev/null || true
    wait "$HEAD_PID" 2>/dev/null || true
}
trap cleanup EXIT
# Ready when the jobs API answers the same client that submits (the Ray CLI, which sends
# the auth token itself: a bare HTTP poll gets 401 under token auth and never succeeds), and
# when the head's dashboard agent, which runs the jobs, has registered with the GCS on the
# port given here (the jobs API answers without it, and then refuses every job).
agent_ready() {
    timeout 15 python - "$GCS_PORT" "$AGENT_PORT" >>"$RAY_TMP/ready.log" 2>&1 <<'PROBE'
import json, sys
from ray._raylet import GcsClient
gcs = GcsClient(address=f"127.0.0.1:{sys.argv[1]}")
keys = gcs.internal_kv_keys(b"DASHBOARD_AGENT_ADDR_NODE_ID_PREFIX:", namespace=b"dashboard", timeout=5)
ports = [json.loads(gcs.internal_kv_get(k, namespace=b"dashboard", timeout=5))[1] for k in keys]
print(f"dashboard agents on HTTP ports {ports}")
sys.exit(0 if int(sys.argv[2]) in ports else 1)
PROBE
}
# Whether something listens on 127.0.0.1:PORT: a bare Python, no Ray import. The checks above
# start a Python that imports Ray (1-2 CPU-s each): they wait until both ports listen, so that
# the wait does not take the cores the head is starting on.
port_open() {
    python -c "import socket, sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), 1).close()" "$1" \
        >"$RAY_TMP/ready.log" 2>&1
}
HEAD_TIMEOUT_S=${KNAPRAY_HEAD_TIMEOUT_S:-120}
deadline=$((SECONDS + HEAD_TIMEOUT_S))
until port_open "$DASH_PORT" && port_open "$AGENT_PORT" \
    && timeout 15 ray job list --address "http://127.0.0.1:$DASH_PORT" >"$RAY_TMP/ready.log" 2>&1 && agent_ready; do
    if ! kill -0 "$HEAD_PID" 2>/dev/null; then
        echo "[submit_demo] error: the Ray head exited before its jobs API answered; its log ($RAY_TMP/head.log) ends:" >&2
        tail -n 20 "$RAY_TMP/head.log" >&2
        exit 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
        echo "[submit_demo] error: the Ray head's jobs API (port $DASH_PORT) and its dashboard agent (port $AGENT_PORT)" \
             "did not answer within ${HEAD_TIMEOUT_S}s (KNAPRAY_HEAD_TIMEOUT_S); nothing submitted; the head's log:" \
             "$RAY_TMP/head.log. Last answer:" >&2
        tail -n 5 "$RAY_TMP/ready.log" >&2
        exit 1
    fi
    sleep 0.5
done
echo "[submit_demo] private Ray head on 127.0.0.1, ports $GCS_PORT (GCS) / $DASH_PORT (jobs) / $AGENT_PORT" \
     "(dashboard agent), takes jobs after ${SECONDS}s (its temp dir: $RAY_TMP)"
if [ "${1:-}" = "--head-only" ]; then
    # The proof: a job the head runs.
    ray job submit --address "http://127.0.0.1:$DASH_PORT" -- python -c "print('[submit_demo] the head ran a job')"
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
