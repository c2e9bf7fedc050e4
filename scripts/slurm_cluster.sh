#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for the tests that submit studies and preempt runs.
#   scripts/slurm_cluster.sh start    install Debian's munge, slurmctld, slurmd and slurm-client when missing (as
#                                     root), write slurm.conf for this host's CPUs and memory, start the daemons and
#                                     wait until the node takes jobs; does nothing more when the cluster is up
#   scripts/slurm_cluster.sh stop     stop the daemons this script's start started, after cancelling the jobs this
#                                     user left on its partition; a cluster it did not start is left alone
#   scripts/slurm_cluster.sh status   one line: up (with the node's state) or down; exit 0 when up
# The cluster has one partition, "debug" (default, 1 hour at most per job), jobs share the node's cores, a job that
# exits with the preemption code may requeue itself, and finished jobs stay visible to squeue/scontrol for 10
# minutes. There is no accounting database (accounting_storage/none): sacct has nothing to read, so the study reads
# a job's state from squeue and scontrol while Slurm knows it, and from the run's folder after (docs/cluster.md).
set -euo pipefail

CONF_DIR=/etc/slurm
STATE_DIR=/var/spool/slurm-ci
LOG_DIR=/var/log/slurm-ci
PARTITION=debug
MAX_TIME=01:00:00

log() { echo "slurm_cluster: $*" >&2; }

is_up() {
    command -v sinfo >/dev/null 2>&1 && timeout 5 sinfo -h -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated|completing)'
}

install_packages() {
    local missing=()
    command -v munged >/dev/null || missing+=(munge)
    command -v slurmctld >/dev/null || missing+=(slurmctld)
    command -v slurmd >/dev/null || missing+=(slurmd)
    command -v sbatch >/dev/null || missing+=(slurm-client)
    [ ${#missing[@]} -eq 0 ] && return
    if [ "$(id -u)" -ne 0 ]; then
        log "missing ${missing[*]}; run as root to install them (apt-get), or install them yourself"
        exit 1
    fi
    log "installing ${missing[*]}"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

HEADER="# Written by scripts/slurm_cluster.sh for this host: one node, one partition."

write_conf() {
    local host cpus memory
    if [ -e "$CONF_DIR/slurm.conf" ] && ! head -n 1 "$CONF_DIR/slurm.conf" | grep -qxF "$HEADER"; then
        log "$CONF_DIR/slurm.conf was not written by this script (a cluster of this machine's own?); it is left as it" \
            "is: stop that cluster's daemons and move the file away to use the test cluster"
        exit 1
    fi
    host=$(hostname -s)
    cpus=$(nproc)
    memory=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 9 / 10))  # MiB, 90% of it for jobs
    mkdir -p "$CONF_DIR" "$STATE_DIR/ctld" "$STATE_DIR/d" "$LOG_DIR"
    chown -R slurm:slurm "$STATE_DIR" "$LOG_DIR"
    cat >"$CONF_DIR/slurm.conf" <<EOF
$HEADER
ClusterName=ci
SlurmctldHost=$host
SlurmUser=slurm
AuthType=auth/munge
# Job credentials live 10 s, not 120: a requeued job waits that long before it may start again (the tests requeue).
# Slurm takes 5 s at least; a credential is checked as its job or step starts, within a second of being made.
AuthInfo=cred_expire=10
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/d
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
JobRequeue=1
MinJobAge=600
KillWait=30
MaxArraySize=1001
DefMemPerCPU=1024
SlurmdTimeout=60
NodeName=$host CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=$PARTITION Nodes=$host Default=YES MaxTime=$MAX_TIME State=UP OverSubscribe=FORCE:4
EOF
}

start_munge() {
    if ! pgrep -u munge -x munged >/dev/null; then
        mkdir -p /run/munge && chown munge:munge /run/munge
        [ -s /etc/munge/munge.key ] || { mungekey --create --force 2>/dev/null || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; }
        chown munge:munge /etc/munge/munge.key && chmod 600 /etc/munge/munge.key
        runuser -u munge -- /usr/sbin/munged
        touch "$STATE_DIR/munged.ours"  # started here: stop stops it too (a munged that was running is left alone)
    fi
}

start() {
    if is_up; then
        log "up already"
        return
    fi
    install_packages
    write_conf
    start_munge
    # Each daemon started here is marked, so that stop stops it and only it.
    pgrep -x slurmctld >/dev/null || { slurmctld && touch "$STATE_DIR/slurmctld.ours"; }
    pgrep -x slurmd >/dev/null || { slurmd && touch "$STATE_DIR/slurmd.ours"; }
    for _ in $(seq 120); do
        if is_up; then
            log "up: partition $PARTITION, $(nproc) CPUs on $(hostname -s)"
            return
        fi
        sleep 0.5
    done
    log "the node did not come up in 60 s; see $LOG_DIR/slurmctld.log and slurmd.log"
    exit 1
}

stop_daemon() {
    local pidfile=$STATE_DIR/$1.pid
    [ -e "$STATE_DIR/$1.ours" ] || return 0  # not started by this script's start: not ours to stop
    rm -f "$STATE_DIR/$1.ours"
    [ -s "$pidfile" ] || return 0
    local pid
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null || return 0
    for _ in $(seq 40); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.25
    done
    kill -9 "$pid" 2>/dev/null || true
}

ours_answers() {
    # The controller that answers is the one start started: Slurm's commands read our slurm.conf, and the
    # slurmctld it names (our pid file) is the one start started and still runs.
    [ -e "$CONF_DIR/slurm.conf" ] && head -n 1 "$CONF_DIR/slurm.conf" | grep -qxF "$HEADER" \
        && [ -e "$STATE_DIR/slurmctld.ours" ] && [ -s "$STATE_DIR/slurmctld.pid" ] \
        && kill -0 "$(cat "$STATE_DIR/slurmctld.pid")" 2>/dev/null
}

stop() {
    if ours_answers; then
        # Only this user's jobs on the test partition: the tests' own.
        scancel --quiet --user="$(id -un)" --partition="$PARTITION" --state=PENDING 2>/dev/null || true
        scancel --full --quiet --user="$(id -un)" --partition="$PARTITION" 2>/dev/null || true
    elif is_up; then
        log "the cluster that answers was not started by this script: no job cancelled, no daemon stopped"
    fi
    stop_daemon slurmd
    stop_daemon slurmctld
    if [ -e "$STATE_DIR/munged.ours" ]; then
        [ -s /run/munge/munged.pid ] && kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true
        rm -f "$STATE_DIR/munged.ours"
    fi
    log "stopped"
}

case "${1:-}" in
start) start ;;
stop) stop ;;
status)
    if is_up; then
        echo "up: $(sinfo -h -o '%P %T %c CPUs %m MiB' | head -n 1)"
    else
        echo "down"
        exit 1
    fi
    ;;
*)
    echo "usage: $0 start|stop|status" >&2
    exit 2
    ;;
esac
