#!/usr/bin/env bash
# Stop the Slurm that infra/slurm/start.sh started: cancel its jobs (so no job process outlives the
# cluster), then stop every node's slurmd, slurmctld and, if start.sh started it, munged, each by the
# pid in its pid file. Safe to run when nothing is running.
set -euo pipefail

STATE=${EIGHTFOLD_SLURM_STATE:-/var/lib/eightfold-slurm}
CONF=$STATE/slurm.conf
log() { echo "slurm: $*" >&2; }
alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

if [[ -f $CONF ]] && alive "$STATE/run/slurmctld.pid"; then
    export SLURM_CONF=$CONF
    jobs=$(timeout 10 squeue -h -o %i 2>/dev/null || true)
    if [[ -n $jobs ]]; then
        log "cancelling jobs: $(echo $jobs)"
        timeout 10 scancel $jobs 2>/dev/null || true
        for _ in $(seq 100); do
            [[ -z $(timeout 5 squeue -h -o %i 2>/dev/null) ]] && break
            sleep 0.2
        done
    fi
fi

# SIGTERM to every daemon named, then wait for all of them (each takes ~2 s to shut down).
stop_daemons() {
    local names=() pids=() files=() i
    for name in "$@"; do
        local file=$STATE/run/$name.pid
        if alive "$file"; then names+=("$name"); pids+=("$(cat "$file")"); files+=("$file"); else rm -f "$file"; fi
    done
    ((${#pids[@]})) || return 0
    kill "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 100); do
        local running=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && running=1; done
        ((running)) || break
        sleep 0.1
    done
    for i in "${!pids[@]}"; do
        if kill -0 "${pids[$i]}" 2>/dev/null; then
            log "${names[$i]} (${pids[$i]}) ignored SIGTERM for 10 s: SIGKILL"
            kill -9 "${pids[$i]}" 2>/dev/null || true
        fi
        rm -f "${files[$i]}"
        log "${names[$i]} stopped"
    done
}

# One slurmd per node (slurmd-<node>.pid); slurmd.pid is the single-node layout of earlier versions.
slurmds=(slurmd)
for f in "$STATE"/run/slurmd-*.pid; do [[ -e $f ]] && slurmds+=("$(basename "$f" .pid)"); done
stop_daemons "${slurmds[@]}" slurmctld
# munged only when start.sh started it (it copied the pid file); a system munged is left alone.
if [[ -s $STATE/run/munged.pid ]]; then
    stop_daemons munged
    rm -f /run/munge/munged.pid
fi
