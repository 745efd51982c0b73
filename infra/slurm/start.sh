#!/usr/bin/env bash
# Start a Slurm of EIGHTFOLD_SLURM_NODES nodes (default 2) on this one machine for tests and laptops:
# munge, slurmctld and one slurmd per node as plain daemons (no systemd, no cgroups).
#
# Two nodes on one machine: Slurm's multiple-slurmd mode. Debian 12's slurm-wlm 22.05.8 accepts it
# as packaged (tried: `slurmd -N <node>` per node, each node line with its own Port=, and %n in the
# slurmd pid, log and spool paths; `srun --nodes=2` then runs one task on each). Network namespaces
# are not needed; see infra/slurm/README.md. The machine's cores are split evenly between the nodes
# (1 CPU each on 2 cores). One node (EIGHTFOLD_SLURM_NODES=1) is the whole machine under its hostname.
#
# Each node has its own scratch dir, $STATE/nodes/<node>/tmp: a TaskProlog exports it to every task
# (the batch script included) as TMPDIR and EIGHTFOLD_NODE_SCRATCH, so no job needs a path the other
# node can see.
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
NODES=${EIGHTFOLD_SLURM_NODES:-2}
PORT_BASE=17001   # slurmd of node i listens on PORT_BASE + i - 1 (multiple-slurmd: one port each)
PACKAGES=(munge slurm-wlm slurmctld slurmd slurm-client)
MUNGE_SOCKET=/run/munge/munge.socket.2

log() { echo "slurm: $*" >&2; }
die() { echo "slurm: error: $*" >&2; exit 1; }

# $1: 1 when this call started the daemons (so the caller knows whether stop.sh is its to run).
print_env() {
    echo "export SLURM_CONF=$CONF"
    echo "export EIGHTFOLD_SLURM_STATE=$STATE"
    echo "export EIGHTFOLD_SLURM_PARTITION=$PARTITION"
    echo "export EIGHTFOLD_SLURM_NODES=$NODES"
    echo "export EIGHTFOLD_SLURM_STARTED_HERE=${1:-0}"
}

alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

[[ $NODES =~ ^[1-9][0-9]*$ ]] || die "EIGHTFOLD_SLURM_NODES='$NODES' must be a whole number >= 1"
host=$(hostname -s)
# Node names: the hostname for one node, <host>-1 ... <host>-N for several.
if ((NODES == 1)); then names=("$host"); else names=(); for i in $(seq "$NODES"); do names+=("$host-$i"); done; fi

# Every node answers: `idle`, or busy with jobs (`mix`, `alloc`); a trailing `*` means not responding.
# The node names must be this call's, so a cluster started with another EIGHTFOLD_SLURM_NODES is not "up".
nodes_ready() {
    local listing
    listing=$(SLURM_CONF=$CONF timeout 5 sinfo -h -N -o '%N %t' 2>/dev/null | sort -u) || return 1
    [[ $(awk '{print $1}' <<<"$listing" | sort) == $(printf '%s\n' "${names[@]}" | sort) ]] || return 1
    ! awk '{print $2}' <<<"$listing" | grep -qvxE 'idle|mix|alloc'
}

is_up() {
    [[ -f $CONF ]] && alive "$STATE/run/slurmctld.pid" || return 1
    local n
    for n in "${names[@]}"; do alive "$STATE/run/slurmd-$n.pid" || return 1; done
    nodes_ready
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
# A cold start is a reboot of the nodes: their scratch dirs start empty.
rm -rf "$STATE/nodes"
for n in "${names[@]}"; do
    mkdir -p "$STATE/spool/$n" "$STATE/nodes/$n/tmp"
    chmod 1777 "$STATE/nodes/$n/tmp"   # a scratch dir like /tmp: any job user may write there
done

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
hw=$(slurmd -C 2>/dev/null | grep '^NodeName=' | head -n1)
[[ -n $hw ]] || die "'slurmd -C' printed no NodeName line"
field() { sed -n "s/.*\b$1=\([0-9]*\).*/\1/p" <<<"$hw"; }
cpus=$(field CPUs) memory=$(field RealMemory)
if ((NODES == 1)); then
    node_lines="${hw#NodeName=* } "   # the hardware exactly as slurmd reports it
    node_lines="NodeName=$host NodeHostname=$host NodeAddr=127.0.0.1 Port=$PORT_BASE $node_lines"
else
    # An even share of the cores per node, described as one socket of that many single-thread cores
    # so Sockets x Cores x Threads equals CPUs (Slurm checks that the three agree).
    per=$((cpus / NODES)); ((per >= 1)) || per=1
    node_lines=""
    for i in $(seq "$NODES"); do
        node_lines+="NodeName=${names[$((i - 1))]} NodeHostname=$host NodeAddr=127.0.0.1 Port=$((PORT_BASE + i - 1))"
        node_lines+=" CPUs=$per Boards=1 SocketsPerBoard=1 CoresPerSocket=$per ThreadsPerCore=1"
        node_lines+=" RealMemory=$((memory / NODES))"$'\n'
    done
fi
node_lines=$(sed 's/$/ State=UNKNOWN/' <<<"${node_lines%$'\n'}")

# The TaskProlog: its `export` lines become the environment of every task of every job.
cat >"$STATE/task-prolog.sh" <<PROLOG_END
#!/bin/sh
# Written by infra/slurm/start.sh: each node's tasks get that node's own scratch dir.
dir=$STATE/nodes/\$SLURMD_NODENAME/tmp
mkdir -p "\$dir"
echo "export TMPDIR=\$dir"
echo "export EIGHTFOLD_NODE_SCRATCH=\$dir"
PROLOG_END
chmod 0755 "$STATE/task-prolog.sh"

cat >"$CONF.tmp" <<CONF_END
# Written by infra/slurm/start.sh: a $NODES-node Slurm on one machine for tests; regenerated at every
# cold start. Several nodes on one host is Slurm's multiple-slurmd mode: one slurmd per node, started
# as \`slurmd -N <node>\`, each with its own Port and its own pid file, log and spool (%n = node name).
ClusterName=eightfold
SlurmctldHost=$host(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
MailProg=/bin/true
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
# Each node's share of the machine is what this file says, not what slurmd measures (the whole host).
SlurmdParameters=config_overrides
# Node-local scratch: TMPDIR and EIGHTFOLD_NODE_SCRATCH = $STATE/nodes/<node>/tmp for every task.
TaskProlog=$STATE/task-prolog.sh
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
$node_lines
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF_END
mv "$CONF.tmp" "$CONF"
chmod 0644 "$CONF"

# 4. Daemons. Stale daemons from an earlier run (some gone, or another node count) are stopped first;
# slurmd.pid is the single-node layout of earlier versions of this script.
stale=()
for f in "$STATE"/run/slurmd-*.pid "$STATE/run/slurmd.pid" "$STATE/run/slurmctld.pid"; do
    if alive "$f"; then stale+=("$(cat "$f")"); fi
    rm -f "$f"
done
if ((${#stale[@]})); then
    kill "${stale[@]}" 2>/dev/null || true
    for _ in $(seq 50); do
        running=0
        for pid in "${stale[@]}"; do kill -0 "$pid" 2>/dev/null && running=1; done
        ((running)) || break
        sleep 0.1
    done
fi
export SLURM_CONF=$CONF
slurmctld 2>>"$STATE/log/slurmctld.stderr" || die "slurmctld did not start; see $STATE/log/slurmctld.log"
for n in "${names[@]}"; do
    slurmd -N "$n" 2>>"$STATE/log/slurmd-$n.stderr" || die "slurmd -N $n did not start; see $STATE/log/slurmd-$n.log"
done
log "slurmctld and ${#names[@]} slurmd started (nodes ${names[*]}; conf $CONF)"

# 5. Wait for every node to report idle.
for _ in $(seq 120); do
    if nodes_ready; then
        log "$NODES node(s) ready in partition $PARTITION: $(sinfo -h -N -o '%N=%t' | sort -u | tr '\n' ' ')"
        print_env 1
        exit 0
    fi
    sleep 0.5
done
die "nodes did not become idle in 60 s: sinfo says '$(sinfo -h -N -o '%N %t' 2>&1 | tr '\n' ' ')'; see $STATE/log/"
