#!/usr/bin/env bash
# A single-node SLURM on loopback (controller, node daemon, accounting), for tests and for trying the
# cluster path on one machine. Debian/Ubuntu, as root. Idempotent: a running cluster is left as it is.
#
#   bash scripts/slurm_local.sh          # install (apt, quiet) if needed, start, wait until the node is idle
#   bash scripts/slurm_local.sh stop     # stop the daemons (slurmd, slurmctld, slurmdbd, munged, mariadb)
#   bash scripts/slurm_local.sh status   # sinfo + daemons
#
# The node gets this machine's cores (CPUs=$(nproc)) and 90% of its memory; partition "debug" (default).
# Accounting (slurmdbd + MariaDB) is on so that sacct works: submitit, and so Hydra's submitit launcher,
# read job states from sacct. Set DRAFTSMITH_SLURM_NO_ACCOUNTING=1 to skip it (plain sbatch still works).
set -euo pipefail

ACCOUNTING=$([[ "${DRAFTSMITH_SLURM_NO_ACCOUNTING:-0}" == 1 ]] && echo 0 || echo 1)
CONF_DIR=/etc/slurm
LOG_DIR=/var/log/slurm
CLUSTER=draftsmith

log() { echo "[slurm_local] $*" >&2; }

need_root() {
    if [[ $(id -u) != 0 ]]; then
        echo "slurm_local.sh must run as root (it installs packages and starts system daemons)" >&2
        exit 1
    fi
}

install_packages() {
    local pkgs=(slurm-wlm munge)
    [[ $ACCOUNTING == 1 ]] && pkgs+=(slurmdbd mariadb-server)
    local missing=()
    for p in "${pkgs[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [[ ${#missing[@]} == 0 ]] && return 0
    log "installing ${missing[*]} (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    # Daemons are started by this script, not by the package's init scripts.
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    rm -f /usr/sbin/policy-rc.d
}

write_config() {
    local cpus mem_mb
    cpus=$(nproc)
    mem_mb=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    mkdir -p "$CONF_DIR" "$LOG_DIR" /var/spool/slurmctld /var/spool/slurmd /run/munge /run/slurm
    cat >"$CONF_DIR/slurm.conf" <<EOF
# Written by scripts/slurm_local.sh: a single-node SLURM on loopback.
ClusterName=$CLUSTER
SlurmctldHost=localhost
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
MaxJobCount=10000
MinJobAge=600
KillWait=30
SchedulerType=sched/backfill
# Test-cluster latencies: a requeued job waits out its old credential's lifetime (cred_expire, default 120 s),
# then the next scheduling pass (sched_interval 60 s / bf_interval 30 s by default); 30 s and 5 s here.
SchedulerParameters=sched_interval=5,bf_interval=5
AuthInfo=cred_expire=30
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
EOF
    if [[ $ACCOUNTING == 1 ]]; then
        cat >>"$CONF_DIR/slurm.conf" <<EOF
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
EOF
        cat >"$CONF_DIR/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
LogFile=$LOG_DIR/slurmdbd.log
PidFile=/run/slurm/slurmdbd.pid
EOF
        chmod 600 "$CONF_DIR/slurmdbd.conf"
    else
        echo "AccountingStorageType=accounting_storage/none" >>"$CONF_DIR/slurm.conf"
    fi
    cat >>"$CONF_DIR/slurm.conf" <<EOF
NodeName=localhost CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
    if munge -n >/dev/null 2>&1; then return 0; fi
    [[ -s /etc/munge/munge.key ]] || { mungekey --create >/dev/null 2>&1 || create-munge-key -f >/dev/null; }
    chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
    chmod 0700 /etc/munge
    chmod 0400 /etc/munge/munge.key
    runuser -u munge -- /usr/sbin/munged --force
    for _ in $(seq 50); do munge -n >/dev/null 2>&1 && return 0; sleep 0.1; done
    log "munged did not start"
    exit 1
}

start_mariadb() {
    if ! mysqladmin ping --silent >/dev/null 2>&1; then
        mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
        [[ -d /var/lib/mysql/mysql ]] || mariadb-install-db --user=mysql >/dev/null 2>&1
        (setsid mysqld_safe --user=mysql >/dev/null 2>&1 &)
        for _ in $(seq 150); do mysqladmin ping --silent >/dev/null 2>&1 && break; sleep 0.2; done
        mysqladmin ping --silent >/dev/null 2>&1 || { log "mariadb did not start"; exit 1; }
    fi
    mysql -u root <<'EOF'
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
FLUSH PRIVILEGES;
EOF
}

running() { ps -C "$1" -o stat= 2>/dev/null | grep -qv '^Z'; }  # a dead daemon lingers as a zombie

start_slurm() {
    if [[ $ACCOUNTING == 1 ]]; then
        start_mariadb
        if ! running slurmdbd; then
            /usr/sbin/slurmdbd
            for _ in $(seq 100); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.2; done
        fi
        sacctmgr -n list cluster format=cluster 2>/dev/null | grep -qw "$CLUSTER" \
            || sacctmgr -i add cluster "$CLUSTER" >/dev/null
    fi
    running slurmctld || /usr/sbin/slurmctld
    running slurmd || /usr/sbin/slurmd -N localhost
    for _ in $(seq 150); do
        state=$(sinfo -h -N -n localhost -o '%T' 2>/dev/null || true)
        case "$state" in
            idle* | mixed* | allocated*) log "node localhost is $state"; return 0 ;;
            down* | drain*) scontrol update nodename=localhost state=resume >/dev/null 2>&1 || true ;;
        esac
        sleep 0.2
    done
    log "the node did not become idle: $(sinfo -N 2>&1 | tail -n +2)"
    tail -n 20 "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log" >&2 || true
    exit 1
}

stop_all() {
    for d in slurmd slurmctld slurmdbd; do
        pid=$(pgrep -x "$d" || true)
        [[ -n $pid ]] && kill $pid 2>/dev/null || true
    done
    if mysqladmin ping --silent >/dev/null 2>&1; then mysqladmin -u root shutdown >/dev/null 2>&1 || true; fi
    pid=$(pgrep -x munged || true)
    [[ -n $pid ]] && kill $pid 2>/dev/null || true
    log "stopped"
}

case "${1:-start}" in
    start)
        need_root
        install_packages
        write_config
        start_munge
        start_slurm
        ;;
    stop)
        need_root
        stop_all
        ;;
    status)
        sinfo -N -l
        for d in munged mariadbd slurmdbd slurmctld slurmd; do printf '%-10s %s\n' "$d" "$(pgrep -x $d || echo -)"; done
        ;;
    *)
        echo "usage: $0 [start|stop|status]" >&2
        exit 2
        ;;
esac
