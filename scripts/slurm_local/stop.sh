#!/usr/bin/env bash
# Stop the cluster started by scripts/slurm_local/start.sh DIR: cancel its jobs, TERM slurmd, slurmctld and
# munged by their pid files, then end the slurmstepd processes of this cluster (they outlive slurmd).
# Never kills by process name: a slurmstepd is ours only when it holds a socket under DIR/spool.
#
#   scripts/slurm_local/stop.sh [DIR]      # DIR defaults to /run/tricorn-slurm
set -uo pipefail

DIR=${1:-${TRICORN_SLURM_DIR:-/run/tricorn-slurm}}
export PATH=$PATH:/usr/sbin
export SLURM_CONF=$DIR/slurm.conf

alive() { [[ -n ${1:-} ]] && kill -0 "$1" 2>/dev/null; }
pid_of() { [[ -f $1 ]] && cat "$1"; }

term_and_wait() { # term_and_wait PIDFILE NAME
    local pid
    pid=$(pid_of "$1") || return 0
    alive "$pid" || return 0
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 50); do alive "$pid" || return 0; sleep 0.1; done
    echo "slurm_local: $2 ($pid) ignored TERM for 5s, sending KILL" >&2
    kill -KILL "$pid" 2>/dev/null
}

# slurmstepd processes whose open unix sockets live under DIR/spool (each step's stepd listens there).
our_stepds() {
    local inodes pid
    inodes=$(awk -v p="$DIR/spool/" 'index($NF, p) == 1 { print $7 }' /proc/net/unix 2>/dev/null | sort -u)
    [[ -n $inodes ]] || return 0
    for pid in $(ls /proc | grep -E '^[0-9]+$'); do
        [[ $(cat "/proc/$pid/comm" 2>/dev/null) == slurmstepd ]] || continue
        for inode in $inodes; do
            if ls -l "/proc/$pid/fd" 2>/dev/null | grep -q "socket:\[$inode\]"; then
                echo "$pid"
                break
            fi
        done
    done
}

if [[ -f $SLURM_CONF ]] && alive "$(pid_of "$DIR/slurmctld.pid")"; then
    jobs=$(squeue -h -o %i 2>/dev/null)
    if [[ -n $jobs ]]; then
        # shellcheck disable=SC2086
        scancel $jobs 2>/dev/null
        for _ in $(seq 50); do [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break; sleep 0.1; done
    fi
fi

stepds=$(our_stepds)
term_and_wait "$DIR/slurmd.pid" slurmd
term_and_wait "$DIR/slurmctld.pid" slurmctld
term_and_wait "$DIR/munge/munged.pid" munged
stepds="$stepds $(our_stepds)"
for pid in $stepds; do
    alive "$pid" && kill -KILL "$pid" 2>/dev/null
done
echo "slurm_local: stopped the cluster in $DIR" >&2
exit 0
