#!/usr/bin/env bash
# Stop the stand-in Kubernetes cluster that infra/k8s/start.sh started: SIGTERM to it (its node then
# SIGKILLs every pod's namespace, so no pod process outlives it), SIGKILL after 15 s. Safe to run
# when nothing is running.
set -euo pipefail

STATE=${EIGHTFOLD_K8S_STATE:-/var/lib/eightfold-k8s}
PID_FILE=$STATE/cluster.pid
log() { echo "k8s: $*" >&2; }

if [[ ! -s $PID_FILE ]] || ! kill -0 "$(cat "$PID_FILE")" 2>/dev/null; then
    rm -f "$PID_FILE"
    log "not running"
    exit 0
fi
pid=$(cat "$PID_FILE")
kill "$pid"
for _ in $(seq 150); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
done
if kill -0 "$pid" 2>/dev/null; then
    log "cluster ($pid) ignored SIGTERM for 15 s: SIGKILL"
    kill -9 "$pid" 2>/dev/null || true
fi
rm -f "$PID_FILE" "$STATE/kubeconfig"
log "stopped"
