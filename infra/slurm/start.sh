#!/usr/bin/env bash
# Start a single-node Slurm on this machine for tests and laptops: munge, slurmctld and slurmd as
# plain daemons (no systemd, no cgroups), the node described by `slurmd -C`.
#
#   eval "$(bash infra/slurm/start.sh)"    # installs if needed, starts, waits for `idle`, exports env
#                                           # (EIGHTFOLD_SLURM_STARTED_HERE=1 when this call started it)
#   bash infra/slurm/start.sh --check       # exit 0 and print the env if it is already up; never starts
#   bash infra/slurm/stop.sh                # cancels its jobs, stops the daemons by their pid files
#
# Idempotent: packages already installed are not reinstalled, daemons already running are kept,
# and a second call returns in well under a second. Progress goes to stderr; stdout carries only
# `export NAME=value` lines. The generated slurm.conf says why each setting is there.
set -euo pipefail

STATE=${EIGHTFOLD_SLURM_STATE:-/var/lib/eightfold-slurm}
CONF=$STATE/slurm.conf
PARTITION=${EIGHTFOLD_SLURM_PARTITION:-eightfold}
PACKAGES=(munge slurm-wlm slurmctld slurmd slurm-client)
MUNGE_SOCKET=/run/munge/munge.socket.2

log() { echo "slurm: $*" >&2; }
die() { echo "slurm: error: $*" >&2; exit 1; }

# $1: 1 when this call started the daemons (so the caller knows whether stop.sh is its to run).
print_env() {
    echo "export SLURM_CONF=$CONF"
    echo "export EIGHTFOLD_SLURM_STATE=$STATE"
    echo "export EIGHTFOLD_SLURM_PARTITION=$PARTITION"
    echo "export EIGHTFOLD_SLURM_STARTED_HERE=${1:-0}"
}

alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# A node that answers: `idle`, or busy with jobs (`mix`, `alloc`). A trailing `*` means not responding.
node_ready() {
    local state
    state=$(SLURM_CONF=$CONF timeout 5 sinfo -h -N -o %t 2>/dev/null | head -n1) || return 1
    [[ $state == idle || $state == mix || $state == alloc ]]
}

is_up() {
    [[ -f $CONF ]] && alive "$STATE/run/slurmctld.pid" && alive "$STATE/run/slurmd.pid" && node_ready
}

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

[[ $(id -u) -eq 0 ]] || die "needs root (apt-get, munge and slurm users); run it as root or under sudo"

# 1. Packages. dpkg-query is the idempotence check: apt-get runs only when something is missing.
missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    # Package scripts try to start services; a policy-rc.d that exits 101 stops them (kept if present).
    made_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made_policy=1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends "${missing[@]}" >"${TMPDIR:-/tmp}/eightfold-slurm-apt.log" 2>&1 ||
        { apt-get update -q >/dev/null 2>&1 &&
          apt-get install -y -q --no-install-recommends "${missing[@]}" >"${TMPDIR:-/tmp}/eightfold-slurm-apt.log" 2>&1; } ||
        die "apt-get install ${missing[*]} failed; see ${TMPDIR:-/tmp}/eightfold-slurm-apt.log"
    ((made_policy)) && rm -f /usr/sbin/policy-rc.d
fi

mkdir -p "$STATE"/{run,log,ctld,spool}
chown slurm:slurm "$STATE/run" "$STATE/log" "$STATE/ctld"   # slurmctld runs as user slurm

# 2. munge. Reuse a munged that already answers; otherwise start one as user munge.
if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "munge already answers"
else
    [[ -s /etc/munge/munge.key ]] || { /usr/sbin/mungekey --create 2>/dev/null || /usr/sbin/create-munge-key -f; }
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge /etc/munge/munge.key
    chmod 0755 /run/munge
    rm -f "$MUNGE_SOCKET"
    runuser -u munge -- /usr/sbin/munged --force
    cp /run/munge/munged.pid "$STATE/run/munged.pid"   # marks munged as ours for stop.sh
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n | unmunge >/dev/null || die "munged does not answer; see /var/log/munge/munged.log"
    log "munged started"
fi

# 3. slurm.conf, from what slurmd sees of this machine.
host=$(hostname -s)
node_line=$(slurmd -C 2>/dev/null | grep '^NodeName=' | head -n1)
[[ -n $node_line ]] || die "'slurmd -C' printed no NodeName line"
cat >"$CONF.tmp" <<CONF_END
# Written by infra/slurm/start.sh: a single-node Slurm for tests; regenerated at every cold start.
ClusterName=eightfold
SlurmctldHost=$host(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
MailProg=/bin/true
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
# No cgroups on this machine: track processes by parentage, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
# Debian's package has no file accounting storage: launchers read "scontrol show job"
# (finished jobs stay visible for MinJobAge seconds) and jobcomp keeps one line per finished job.
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE/log/jobcomp.log
MinJobAge=86400
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
InactiveLimit=0
KillWait=5
SlurmctldTimeout=120
SlurmdTimeout=300
$node_line NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF_END
mv "$CONF.tmp" "$CONF"
chmod 0644 "$CONF"

# 4. Daemons. A stale daemon from an earlier run (one of the two gone) is stopped first.
for d in slurmd slurmctld; do
    if alive "$STATE/run/$d.pid"; then kill "$(cat "$STATE/run/$d.pid")" 2>/dev/null || true; fi
done
for _ in $(seq 50); do
    alive "$STATE/run/slurmd.pid" || alive "$STATE/run/slurmctld.pid" || break
    sleep 0.1
done
export SLURM_CONF=$CONF
slurmctld 2>>"$STATE/log/slurmctld.stderr" || die "slurmctld did not start; see $STATE/log/slurmctld.log"
slurmd 2>>"$STATE/log/slurmd.stderr" || die "slurmd did not start; see $STATE/log/slurmd.log"
log "slurmctld and slurmd started (conf $CONF)"

# 5. Wait for the node to report idle.
for _ in $(seq 120); do
    if node_ready; then
        log "node $host is $(sinfo -h -N -o %t | head -n1) in partition $PARTITION"
        print_env 1
        exit 0
    fi
    sleep 0.5
done
die "node did not become idle in 60 s: sinfo says '$(sinfo -h -N -o %t 2>&1 | head -n1)'; see $STATE/log/"
