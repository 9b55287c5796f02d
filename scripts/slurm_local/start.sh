#!/usr/bin/env bash
# Start a single-node SLURM cluster (munged + slurmctld + slurmd) on this machine, as root, without systemd.
#
#   scripts/slurm_local/start.sh [DIR]     # DIR defaults to /run/tricorn-slurm
#   export SLURM_CONF=DIR/slurm.conf       # the last line printed is SLURM_CONF=...
#   sbatch ...; squeue; scontrol show job ID
#   scripts/slurm_local/stop.sh DIR
#
# Installs Debian's slurmctld/slurmd/slurm-client/munge with apt-get when they are missing (policy-rc.d must
# keep the package scripts from starting daemons). Everything the cluster writes - munge key and socket, state,
# spool, pid files, logs, slurm.conf - lives under DIR. DIR must be reachable by munge: its socket directory is
# 755 and every parent world-executable, which /run/<name> is and /root is not.
# Used by tests/test_slurm_local.py; see scripts/slurm/README.md.
set -euo pipefail

DIR=${1:-${TRICORN_SLURM_DIR:-/run/tricorn-slurm}}
CTLD_PORT=${TRICORN_SLURMCTLD_PORT:-6817}
SLURMD_PORT=${TRICORN_SLURMD_PORT:-6818}

die() {
    echo "slurm_local: error: $*" >&2
    exit 1
}

[[ $(id -u) == 0 ]] || die "must run as root (slurmd and munged are started as root here)"

install_packages() {
    # Package installs must not start daemons: Debian's policy-rc.d protocol, exit 101 = "deny".
    local policy=/usr/sbin/policy-rc.d created_policy=0
    if ! { [[ -x $policy ]] && { "$policy" >/dev/null 2>&1; [[ $? == 101 ]]; }; }; then
        [[ -e $policy ]] && die "$policy exists but does not exit 101; installing slurm would start daemons"
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod 755 "$policy"
        created_policy=1
    fi
    echo "slurm_local: installing slurmctld slurmd slurm-client munge with apt-get" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >&2
    if [[ $created_policy == 1 ]]; then rm -f "$policy"; fi
}

missing=0
for tool in slurmctld slurmd sbatch srun scontrol sinfo munged mungekey; do
    command -v "$tool" >/dev/null 2>&1 || PATH=$PATH:/usr/sbin command -v "$tool" >/dev/null 2>&1 || missing=1
done
[[ $missing == 0 ]] || install_packages
export PATH=$PATH:/usr/sbin

if [[ -f $DIR/slurmctld.pid ]] && kill -0 "$(cat "$DIR/slurmctld.pid")" 2>/dev/null; then
    die "a cluster is already running in $DIR; stop it with scripts/slurm_local/stop.sh $DIR"
fi
mkdir -p "$DIR"
rm -rf "${DIR:?}"/{munge,state,spool,log}
mkdir -p "$DIR"/{munge,state,spool,log}
chmod 755 "$DIR" "$DIR/munge"

# ---- munge: own key, socket, pid, log and seed under DIR
SOCK=$DIR/munge/munge.socket
mungekey -c -k "$DIR/munge/munge.key" -f
chmod 600 "$DIR/munge/munge.key"
munged --key-file="$DIR/munge/munge.key" --socket="$SOCK" --pid-file="$DIR/munge/munged.pid" \
    --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed" --force
for _ in $(seq 100); do [[ -S $SOCK ]] && break; sleep 0.05; done
[[ -S $SOCK ]] || die "munged did not create its socket $SOCK; see $DIR/log/munged.log"

# ---- slurm.conf: the node line is slurmd -C's own (a hand-written CPUs= makes the node unusable)
NODE_LINE=$(slurmd -C | head -n 1)
[[ $NODE_LINE == NodeName=* ]] || die "slurmd -C printed no node line: $NODE_LINE"
NODE_NAME=$(sed -E 's/^NodeName=([^ ]+).*/\1/' <<<"$NODE_LINE")
CONF=$DIR/slurm.conf
cat >"$CONF.tmp" <<EOF
# Written by scripts/slurm_local/start.sh: a single-node cluster for tests, everything under $DIR.
ClusterName=tricorn-local
SlurmctldHost=$NODE_NAME(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCK,cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
ReturnToService=2
SchedulerParameters=batch_sched_delay=0,bf_interval=1,sched_interval=2
$NODE_LINE NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
mv "$CONF.tmp" "$CONF"
export SLURM_CONF=$CONF

wait_for() { # wait_for SECONDS DESCRIPTION COMMAND...
    local secs=$1 what=$2
    shift 2
    for _ in $(seq $((secs * 10))); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.1
    done
    die "$what did not come up within ${secs}s; see $DIR/log/"
}
ctld_up() { scontrol ping | grep -q "is UP"; }
node_idle() { [[ $(sinfo -h -N -o %T | head -n 1) == idle ]]; }

slurmctld -f "$CONF"
wait_for 30 slurmctld ctld_up
slurmd -f "$CONF"
wait_for 30 "slurmd (node $NODE_NAME idle)" node_idle

echo "slurm_local: cluster up in $DIR (node: $NODE_LINE)" >&2
echo "SLURM_CONF=$CONF"
