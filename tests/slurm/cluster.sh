#!/usr/bin/env bash
# A Slurm cluster on this host for the tests: `cluster.sh up` (installs Debian's slurm-wlm and munge
# when missing; needs root), `cluster.sh down`, `cluster.sh env` (prints the SLURM_CONF line to export).
# Partition `debug` (the default) is this host: one node, four fake GPUs. Partition `two` is two more
# nodes, e3n1 and e3n2, each a slurmd in its own network, UTS and mount namespace on a veth bridge
# (10.73.0.0/24; the names resolve inside them through a hosts file of their own): a job there runs on
# "another host" as far as Slurm, torchrun and eagle3 can tell, while the filesystem is shared, as a
# cluster's is. Partition `spare` (e3n3, e3n4) is the same again, for the test that kills a node, so
# that no other test's job is on it. Where namespaces or veth links cannot be made, the cluster has the one node and
# $DIR/two-nodes.unavailable says why (the 2-node tests skip with it).
# Everything lives in $EAGLE3_SLURM_DIR (default /tmp/eagle3-slurm), munge included (its own key,
# socket and munged): /etc/slurm and /etc/munge are not touched, and a munged or Slurm the host
# already runs is left alone. `down` stops only what `up` started here.
set -euo pipefail

DIR=${EAGLE3_SLURM_DIR:-/tmp/eagle3-slurm}
CONF=$DIR/slurm.conf
HOST=$(hostname -s)
MUNGE=$DIR/munge
export SLURM_CONF=$CONF
CLUSTER=eagle3test
BRIDGE=e3br0
NET=10.73.0
NODES="e3n1 e3n2 e3n3 e3n4"

say() { echo "cluster.sh: $*" >&2; }
running() { [ -f "$DIR/$1.pid" ] && kill -0 "$(cat "$DIR/$1.pid")" 2>/dev/null; }
node_ip() { echo "$NET.1${1#e3n}"; }  # e3n1 → 10.73.0.11

# The two namespaced nodes' network: a bridge on this host ($NET.1) and one veth pair per node.
# Prints nothing and returns 0 when it stands; else prints why not.
make_net() {
    command -v ip >/dev/null || { echo "no \`ip\` command (iproute2)"; return 1; }
    ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge 2>&1 || return 1
    ip addr show "$BRIDGE" | grep -q "$NET.1/" || ip addr add "$NET.1/24" dev "$BRIDGE" 2>&1 || return 1
    ip link set "$BRIDGE" up 2>&1 || return 1
    for n in $NODES; do
        ns=eagle3-$n
        ip netns list | grep -qw "$ns" || ip netns add "$ns" 2>&1 || return 1
        if ! ip link show "v$n" >/dev/null 2>&1; then
            ip link add "v$n" type veth peer name eth0 netns "$ns" 2>&1 || return 1
            ip link set "v$n" master "$BRIDGE" up 2>&1 || return 1
            ip -n "$ns" addr add "$(node_ip "$n")/24" dev eth0 2>&1 || return 1
        fi
        ip -n "$ns" link set lo up 2>&1 && ip -n "$ns" link set eth0 up 2>&1 || return 1
    done
}

drop_net() {
    for n in $NODES; do
        ip link del "v$n" 2>/dev/null || true
        ip netns del "eagle3-$n" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
}

# slurmd as node $1: in its namespace, with its own hostname and /etc/hosts (bound over, in its own mount
# namespace only), so that the node names resolve there as a cluster's DNS would resolve them.
# (nsenter, not `ip netns exec`: that remounts /sys, and slurmd needs the host's /sys/fs/cgroup)
start_node() {
    nsenter --net="/run/netns/eagle3-$1" unshare --uts --mount --propagation private \
        bash -c 'hostname "$1" && mount --bind "$2/hosts" /etc/hosts && exec slurmd -N "$1"' _ "$1" "$DIR" \
        2>>"$DIR/slurmd-$1.err"
}

install() {
    command -v slurmctld >/dev/null && command -v munged >/dev/null && return 0
    [ "$(id -u)" = 0 ] || { say "slurm-wlm and munge are not installed and this is not root: cannot install them"; exit 3; }
    say "installing slurm-wlm and munge with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q slurm-wlm munge >"$DIR/apt.log" 2>&1 ||
        { apt-get update -q >>"$DIR/apt.log" 2>&1 && apt-get install -y -q slurm-wlm munge >>"$DIR/apt.log" 2>&1; } ||
        { say "apt-get could not install slurm-wlm and munge (see $DIR/apt.log)"; exit 3; }
}

write_conf() {  # $1: the controller's address (127.0.0.1, or the bridge's where the two nodes stand)
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/gpus"
    for i in 0 1 2 3; do : >"$DIR/gpus/gpu$i"; done  # four fake GPUs: gres needs files, not devices
    cat >"$CONF" <<CONF
ClusterName=$CLUSTER
SlurmctldHost=$HOST($1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE/munge.socket,cred_expire=10
SlurmctldPort=${EAGLE3_SLURM_PORT:-16817}
SlurmdPort=$(( ${EAGLE3_SLURM_PORT:-16817} + 1 ))
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
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
SlurmdTimeout=10
JobRequeue=1
SchedulerParameters=bf_interval=2,sched_interval=2
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=2
NodeName=$HOST NodeAddr=$1 CPUs=16 RealMemory=16000 Gres=gpu:4 State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF
    printf 'AutoDetect=off\nNodeName=%s Name=gpu File=%s/gpus/gpu[0-3]\n' "$HOST" "$DIR" >"$DIR/gres.conf"
    [ "$1" = 127.0.0.1 ] && return 0
    for n in $NODES; do
        echo "NodeName=$n NodeAddr=$(node_ip "$n") CPUs=8 RealMemory=8000 Gres=gpu:2 State=UNKNOWN" >>"$CONF"
        printf 'NodeName=%s Name=gpu File=%s/gpus/gpu[0-1]\n' "$n" "$DIR" >>"$DIR/gres.conf"
        mkdir -p "$DIR/spool/$n"
    done
    echo "PartitionName=two Nodes=e3n1,e3n2 MaxTime=INFINITE State=UP" >>"$CONF"
    echo "PartitionName=spare Nodes=e3n3,e3n4 MaxTime=INFINITE State=UP" >>"$CONF"
    printf '127.0.0.1 localhost\n%s.1 %s\n' "$NET" "$HOST" >"$DIR/hosts"
    for n in $NODES; do echo "$(node_ip "$n") $n" >>"$DIR/hosts"; done
}

up() {  # $1: why this cluster is to be the one node (a second try after the namespaced nodes failed)
    mkdir -p "$DIR"
    install
    if running slurmctld && running "slurmd-$HOST"; then say "already up ($CONF)"; return 0; fi
    down >/dev/null 2>&1 || true  # half a cluster: start it all afresh
    mkdir -p "$DIR"
    rm -f "$DIR/two-nodes.unavailable"
    if [ -n "${1:-}" ]; then
        echo "$1" >"$DIR/two-nodes.unavailable"
    elif [ "${EAGLE3_SLURM_ONE_NODE:-}" ]; then
        echo "EAGLE3_SLURM_ONE_NODE is set" >"$DIR/two-nodes.unavailable"
    elif ! why=$(make_net); then
        echo "cannot make the two nodes' network namespaces and veth bridge: ${why:-ip failed}" >"$DIR/two-nodes.unavailable"
        drop_net
    fi
    if [ -f "$DIR/two-nodes.unavailable" ]; then write_conf 127.0.0.1; else write_conf "$NET.1"; fi
    if ! running munge/munged; then  # our own munged: its key and socket under $DIR, never /etc/munge's
        mkdir -p "$MUNGE" && chmod 700 "$MUNGE"
        [ -s "$MUNGE/munge.key" ] || dd if=/dev/urandom of="$MUNGE/munge.key" bs=1 count=1024 2>/dev/null
        chmod 400 "$MUNGE/munge.key"
        munged --force --key-file="$MUNGE/munge.key" --socket="$MUNGE/munge.socket" --pid-file="$MUNGE/munged.pid" \
            --log-file="$MUNGE/munged.log" --seed-file="$MUNGE/munged.seed" 2>>"$DIR/munged.log"
    fi
    slurmctld -i 2>>"$DIR/slurmctld.err"  # -i: ignore state left by an earlier cluster in $DIR
    slurmd -N "$HOST" 2>>"$DIR/slurmd.err"
    nodes=$HOST
    if [ ! -f "$DIR/two-nodes.unavailable" ]; then
        for n in $NODES; do
            start_node "$n" || { one_node "slurmd of node $n did not start: $(tail -2 "$DIR/slurmd-$n.log" 2>/dev/null |
                tr '\n' ' ')"; return; }
        done
        nodes="$HOST ${NODES}"
    fi
    for _ in $(seq 1 60); do
        idle=1
        for n in $nodes; do
            state=$(sinfo -h -n "$n" -o %t 2>/dev/null || true)
            [ "$state" = idle ] || idle=0
            case "$state" in down*|drain*) scontrol update nodename="$n" state=resume 2>/dev/null || true ;; esac
        done
        [ $idle = 1 ] && { say "up: $nodes idle ($CONF)$([ -f "$DIR/two-nodes.unavailable" ] && echo "; one node only: $(cat "$DIR/two-nodes.unavailable")")"; return 0; }
        sleep 0.5
    done
    said="the nodes did not become idle: $(sinfo 2>&1 | tail -3 | tr '\n' ' '); see $DIR/slurmctld.log and $DIR/slurmd-*.log"
    if [ "$nodes" != "$HOST" ] && [ "$(sinfo -h -n "$HOST" -o %t 2>/dev/null)" = idle ]; then
        one_node "$said"
        return
    fi
    say "$said"
    exit 4
}

# The namespaced nodes failed: start again as the one-node cluster, which still serves every other test, with why.
one_node() {
    down >/dev/null 2>&1 || true
    up "$1"
}

# `cluster.sh node-up NODE` / `node-kill NODE`: a namespaced node's slurmd back, or the node killed as a
# power loss would (its slurmd, its job steps and their processes: everything in its network namespace).
node_kill() {
    pids=$(ip netns pids "eagle3-$1" 2>/dev/null || true)
    [ -n "$pids" ] && kill -9 $pids 2>/dev/null || true
    rm -f "$DIR/slurmd-$1.pid"
}

down() {
    # only this cluster's jobs: SLURM_CONF is ours, and the controller that answers must be ours
    if running slurmctld && scontrol show config 2>/dev/null | grep -Eq "^ClusterName +=  *$CLUSTER$"; then
        scancel --full --signal=KILL -u root 2>/dev/null || true
    fi
    for n in $NODES; do node_kill "$n"; done
    for daemon in "slurmd-$HOST" slurmctld munge/munged; do
        running "$daemon" && kill "$(cat "$DIR/$daemon.pid")" 2>/dev/null || true
    done
    for _ in $(seq 1 50); do  # until they have exited: the next `up` may reuse their ports
        running "slurmd-$HOST" || running slurmctld || running munge/munged || break
        sleep 0.1
    done
    drop_net
    rm -f "$DIR/slurmd-$HOST.pid" "$DIR/slurmctld.pid" "$MUNGE/munged.pid"
    say "down"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    env) echo "SLURM_CONF=$CONF" ;;
    node-kill) node_kill "$2" ;;
    node-up) start_node "$2" ;;
    *) echo "usage: $0 up|down|env|node-kill NODE|node-up NODE" >&2; exit 2 ;;
esac
