#!/usr/bin/env bash
# Start the stand-in Kubernetes cluster (infra/k8s/: API server, controllers, one node that runs pods
# as local processes in their own namespaces) in the background, for laptops, CI and kubectl.
# No real kube-apiserver installs from the registries this project may use: README.md beside this
# file says what was tried. Nothing is downloaded: the cluster is this checkout's Python.
#
#   eval "$(bash infra/k8s/start.sh)"    # starts it (or finds it up), waits for its API, exports
#                                         # KUBECONFIG (EIGHTFOLD_K8S_STARTED_HERE=1 when this call started it)
#   bash infra/k8s/start.sh --check       # exit 0 and print the env if it is already up; never starts
#   bash infra/k8s/stop.sh                # stops it: every pod's processes end with it
#
# Idempotent: a cluster already up is kept. Progress goes to stderr; stdout carries only `export` lines.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
STATE=${EIGHTFOLD_K8S_STATE:-/var/lib/eightfold-k8s}
PORT=${EIGHTFOLD_K8S_PORT:-16443}
PY=${EIGHTFOLD_K8S_PYTHON:-$ROOT/.venv/bin/python}
[[ -x $PY ]] || PY=$(command -v python3)

log() { echo "k8s: $*" >&2; }
die() { echo "k8s: error: $*" >&2; exit 1; }

print_env() {
    echo "export KUBECONFIG=$STATE/kubeconfig"
    echo "export EIGHTFOLD_K8S_STATE=$STATE"
    echo "export EIGHTFOLD_K8S_STARTED_HERE=${1:-0}"
}

alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
answers() { "$PY" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "http://127.0.0.1:$PORT/version" 2>/dev/null; }
is_up() { alive "$STATE/cluster.pid" && [[ -s $STATE/kubeconfig ]] && answers; }

if [[ ${1:-} == --check ]]; then
    if is_up; then print_env; exit 0; fi
    exit 1
fi
[[ $# -eq 0 ]] || die "unknown argument '$1' (use no argument or --check)"

if is_up; then
    log "already running (state in $STATE)"
    print_env
    exit 0
fi

[[ $(id -u) -eq 0 ]] || die "needs root: the node gives every pod its own mount, PID and UTS namespaces"
command -v unshare >/dev/null || die "unshare (util-linux) is missing: apt-get install util-linux"
why=$(cd "$ROOT" && "$PY" -c "from infra.k8s.node import node_can_run_pods as w; print(w() or '')") \
    || die "cannot import infra.k8s with $PY (set EIGHTFOLD_K8S_PYTHON to the project's venv python)"
[[ -z $why ]] || die "$why"

mkdir -p "$STATE"
rm -f "$STATE/kubeconfig"
cd "$ROOT"
# A simple command in the background, so $! is the cluster's own pid (what stop.sh signals).
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" nohup "$PY" -m infra.k8s.cluster --root "$STATE" --port "$PORT" \
    >"$STATE/cluster.log" 2>&1 </dev/null &
echo $! >"$STATE/cluster.pid"
for _ in $(seq 100); do
    is_up && break
    alive "$STATE/cluster.pid" || die "the cluster exited at start: $(tail -n 20 "$STATE/cluster.log")"
    sleep 0.1
done
is_up || die "the API on 127.0.0.1:$PORT did not answer within 10 s: $(tail -n 20 "$STATE/cluster.log")"
log "up: API http://127.0.0.1:$PORT, kubeconfig $STATE/kubeconfig, log $STATE/cluster.log"
print_env 1
