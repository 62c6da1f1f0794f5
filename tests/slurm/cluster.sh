#!/usr/bin/env bash
# A one-node Slurm cluster on this host for the tests: `cluster.sh up` (installs Debian's
# slurm-wlm and munge when missing; needs root), `cluster.sh down`, `cluster.sh env` (prints the
# SLURM_CONF line to export). Everything lives in $EAGLE3_SLURM_DIR (default /tmp/eagle3-slurm),
# munge included (its own key, socket and munged): /etc/slurm and /etc/munge are not touched, and a
# munged or Slurm the host already runs is left alone. `down` stops only what `up` started here.
set -euo pipefail

DIR=${EAGLE3_SLURM_DIR:-/tmp/eagle3-slurm}
CONF=$DIR/slurm.conf
HOST=$(hostname -s)
MUNGE=$DIR/munge
export SLURM_CONF=$CONF
CLUSTER=eagle3test

say() { echo "cluster.sh: $*" >&2; }
running() { [ -f "$DIR/$1.pid" ] && kill -0 "$(cat "$DIR/$1.pid")" 2>/dev/null; }

install() {
    command -v slurmctld >/dev/null && command -v munged >/dev/null && return 0
    [ "$(id -u)" = 0 ] || { say "slurm-wlm and munge are not installed and this is not root: cannot install them"; exit 3; }
    say "installing slurm-wlm and munge with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q slurm-wlm munge >"$DIR/apt.log" 2>&1 ||
        { apt-get update -q >>"$DIR/apt.log" 2>&1 && apt-get install -y -q slurm-wlm munge >>"$DIR/apt.log" 2>&1; } ||
        { say "apt-get could not install slurm-wlm and munge (see $DIR/apt.log)"; exit 3; }
}

write_conf() {
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/gpus"
    for i in 0 1 2 3; do : >"$DIR/gpus/gpu$i"; done  # four fake GPUs: gres needs files, not devices
    cat >"$CONF" <<CONF
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE/munge.socket
SlurmctldPort=${EAGLE3_SLURM_PORT:-16817}
SlurmdPort=$(( ${EAGLE3_SLURM_PORT:-16817} + 1 ))
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmdParameters=config_overrides
DefMemPerCPU=100
GresTypes=gpu
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.txt
ReturnToService=2
SchedulerType=sched/backfill
MpiDefault=none
KillWait=5
MinJobAge=300
InactiveLimit=0
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=16 RealMemory=16000 Gres=gpu:4 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
    printf 'AutoDetect=off\nName=gpu File=%s/gpus/gpu[0-3]\n' "$DIR" >"$DIR/gres.conf"
}

up() {
    mkdir -p "$DIR"
    install
    if running slurmctld && running slurmd; then say "already up ($CONF)"; return 0; fi
    down >/dev/null 2>&1 || true  # half a cluster: start both afresh
    write_conf
    if ! running munge/munged; then  # our own munged: its key and socket under $DIR, never /etc/munge's
        mkdir -p "$MUNGE" && chmod 700 "$MUNGE"
        [ -s "$MUNGE/munge.key" ] || dd if=/dev/urandom of="$MUNGE/munge.key" bs=1 count=1024 2>/dev/null
        chmod 400 "$MUNGE/munge.key"
        munged --force --key-file="$MUNGE/munge.key" --socket="$MUNGE/munge.socket" --pid-file="$MUNGE/munged.pid" \
            --log-file="$MUNGE/munged.log" --seed-file="$MUNGE/munged.seed" 2>>"$DIR/munged.log"
    fi
    slurmctld -i 2>>"$DIR/slurmctld.err"  # -i: ignore state left by an earlier cluster in $DIR
    slurmd 2>>"$DIR/slurmd.err"
    for _ in $(seq 1 60); do
        state=$(sinfo -h -o %t 2>/dev/null || true)
        [ "$state" = idle ] && { say "up: node $HOST idle, 4 fake GPUs ($CONF)"; return 0; }
        case "$state" in down*|drain*) scontrol update nodename="$HOST" state=resume 2>/dev/null || true ;; esac
        sleep 0.5
    done
    say "the node did not become idle: $(sinfo 2>&1 | tail -1); see $DIR/slurmctld.log and $DIR/slurmd.log"
    exit 4
}

down() {
    # only this cluster's jobs: SLURM_CONF is ours, and the controller that answers must be ours
    if running slurmctld && scontrol show config 2>/dev/null | grep -Eq "^ClusterName +=  *$CLUSTER$"; then
        scancel --full --signal=KILL -u root 2>/dev/null || true
    fi
    for daemon in slurmd slurmctld munge/munged; do
        running "$daemon" && kill "$(cat "$DIR/$daemon.pid")" 2>/dev/null || true
    done
    for _ in $(seq 1 50); do  # until both have exited: the next `up` may reuse their ports
        running slurmd || running slurmctld || running munge/munged || break
        sleep 0.1
    done
    rm -f "$DIR/slurmd.pid" "$DIR/slurmctld.pid" "$MUNGE/munged.pid"
    say "down"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    env) echo "SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 up|down|env" >&2; exit 2 ;;
esac
