#!/usr/bin/env bash
# start-slurm.sh - batchgen's CI fixture: a real single-node Slurm cluster on localhost.
#
# Installs Debian's packages (munge, slurmctld, slurmd, slurm-client, slurmdbd, mariadb-server),
# writes /etc/slurm/{slurm,gres,slurmdbd}.conf and starts, in the background and without systemd or
# cgroups: munged, a private MariaDB + slurmdbd (accounting: sacct, and submitit needs it to see a
# cancelled job's state), slurmctld and slurmd. Every daemon's PID goes to $ROOT/pids/NAME.pid;
# stop-slurm.sh stops exactly those PIDs. Must run as root. Idempotent: when the cluster is already
# up it only re-checks that the node is idle (< 1 s); from nothing installed it takes ~15 s + apt.
#
# The node mimics a GPU node without having GPUs: it declares BATCHGEN_SLURM_GPUS "gpu" GRES backed by
# stand-in device files ($ROOT/fakegpu/gpuN, character devices with /dev/null's numbers: slurmd drops
# a file-less gpu GRES) so that jobs/slurm/generate.sbatch schedules with its real `--gres=gpu:1`;
# Slurm then sets CUDA_VISIBLE_DEVICES as usual and the job runs on CPU. It also declares
# BATCHGEN_SLURM_CPUS CPUs (default: at least 4, more than a 2-core CI machine has) so that a
# 4-task array runs at once instead of in two waves. AuthInfo=cred_expire (default 120 s, here
# BATCHGEN_SLURM_CRED_EXPIRE=5, the least Slurm accepts) is also how long a requeued job waits before it
# may start again, and the scheduler runs every 2 s (not 60/30 s), so a requeued task restarts ~7 s after
# it stopped.
#
# Env: BATCHGEN_SLURM_ROOT   state, logs, pids          (default /tmp/batchgen-slurm)
#      BATCHGEN_SLURM_ACCOUNTING 1|0 slurmdbd+MariaDB   (default 1; a Hydra/submitit sweep needs it)
#      BATCHGEN_SLURM_DB_PORT MariaDB port on 127.0.0.1  (default 13306)
#      BATCHGEN_SLURM_CPUS, BATCHGEN_SLURM_GPUS          (default max(nproc,4), 4)
#      BATCHGEN_SLURM_TIMEOUT seconds to wait for the node to be idle (default 90)
set -euo pipefail
ROOT=${BATCHGEN_SLURM_ROOT:-/tmp/batchgen-slurm}
ACCT=${BATCHGEN_SLURM_ACCOUNTING:-1}
DBPORT=${BATCHGEN_SLURM_DB_PORT:-13306}
TIMEOUT=${BATCHGEN_SLURM_TIMEOUT:-90}
NCPU=$(nproc)
CPUS=${BATCHGEN_SLURM_CPUS:-$((NCPU > 4 ? NCPU : 4))}
GPUS=${BATCHGEN_SLURM_GPUS:-4}
CRED_EXPIRE=${BATCHGEN_SLURM_CRED_EXPIRE:-5}
NODE=localhost
CLUSTER=batchgen
PIDS=$ROOT/pids LOG=$ROOT/log
export DEBIAN_FRONTEND=noninteractive
t0=$(date +%s)
say() { echo "[start-slurm +$(($(date +%s) - t0))s] $*"; }
die() {
  echo "[start-slurm] ERROR: $*" >&2
  tail -n 25 "$LOG"/*.log "$LOG"/*.stdout 2>/dev/null >&2 || true
  exit 1
}
[[ $(id -u) == 0 ]] || die "must run as root (it installs packages and starts daemons)"

# 1. packages ---------------------------------------------------------------------------------
pkgs=(munge slurmctld slurmd slurm-client)
[[ $ACCT == 1 ]] && pkgs+=(slurmdbd mariadb-server)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  say "installing ${missing[*]}"
  apt-get -o DPkg::Lock::Timeout=300 update -qq
  apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
say "slurm $(slurmd -V | awk '{print $2}'), $(munged --version | awk '{print $1}')"

mkdir -p "$ROOT"/{state,spool,run,pids,log} /etc/slurm

# is_running NAME COMM: our pidfile names a live, non-zombie process whose comm is COMM.
is_running() {
  local f=$PIDS/$1.pid pid c st
  [[ -s $f ]] || return 1
  pid=$(<"$f")
  read -r _ c st _ 2>/dev/null <"/proc/$pid/stat" || return 1
  [[ $c == "($2)" && $st != Z ]]
}
# start_daemon NAME COMM CMD...: CMD must stay in the foreground; it gets its own session.
start_daemon() {
  local name=$1 comm=$2 pid
  shift 2
  if is_running "$name" "$comm"; then
    say "$name already running (pid $(<"$PIDS/$name.pid"))"
    return 0
  fi
  setsid "$@" </dev/null >>"$LOG/$name.stdout" 2>&1 &
  pid=$!
  echo "$pid" >"$PIDS/$name.pid"
  sleep 0.5
  is_running "$name" "$comm" || die "$name (pid $pid) exited at startup or is not '$comm'"
  say "started $name (pid $pid)"
}
# wait_for WHAT SECONDS CMD...
wait_for() {
  local what=$1 n=$2 i
  shift 2
  for ((i = 0; i < n * 2; i++)); do
    "$@" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  die "timed out waiting for $what"
}

# 2. munge ------------------------------------------------------------------------------------
if [[ ! -s /etc/munge/munge.key ]]; then
  mungekey --create --keyfile=/etc/munge/munge.key
  chown munge:munge /etc/munge/munge.key
  chmod 400 /etc/munge/munge.key
fi
install -d -o munge -g munge -m 755 /run/munge
if ! is_running munged munged && munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  say "a munged not started by this script already answers; using it"
else
  start_daemon munged munged setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged -F
  wait_for munge 15 bash -c 'munge -n | unmunge'
fi

# 3. slurm.conf + gres.conf -------------------------------------------------------------------
# Memory from `slurmd -C` (95% of it: slurmd refuses a node whose RealMemory exceeds what it finds).
mem=$(slurmd -C | sed -nE '1s/.*RealMemory=([0-9]+).*/\1/p')
if [[ $ACCT == 1 ]]; then
  acct="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/linux"
else
  acct="AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none"
fi
gres_node=""
if ((GPUS > 0)); then gres_node="Gres=gpu:$GPUS"; fi
cat >"$ROOT/slurm.conf.new" <<EOF
# generated by batchgen jobs/ci/start-slurm.sh
ClusterName=$CLUSTER
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=$CRED_EXPIRE
StateSaveLocation=$ROOT/state
SlurmdSpoolDir=$ROOT/spool
SlurmctldPidFile=$ROOT/run/slurmctld.pid
SlurmdPidFile=$ROOT/run/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
# debug2 logs each 30 s time-limit pass ("Testing job time limits"): tests/test_slurm.py reads its phase
# to time a job so that its --signal=B:USR1@N warning lands mid-run.
SlurmctldDebug=debug2
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmdParameters=config_overrides
DefMemPerCPU=1024
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait=10
GresTypes=gpu
$acct
JobCompType=jobcomp/none
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$((mem * 95 / 100)) $gres_node State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
if ((GPUS > 0)); then
  mkdir -p "$ROOT/fakegpu"
  for ((i = 0; i < GPUS; i++)); do
    [[ -c $ROOT/fakegpu/gpu$i ]] || mknod "$ROOT/fakegpu/gpu$i" c 1 3
  done
  echo "NodeName=$NODE Name=gpu File=$ROOT/fakegpu/gpu[0-$((GPUS - 1))]" >"$ROOT/gres.conf.new"
else
  : >"$ROOT/gres.conf.new"
fi
if ! cmp -s "$ROOT/slurm.conf.new" /etc/slurm/slurm.conf || ! cmp -s "$ROOT/gres.conf.new" /etc/slurm/gres.conf; then
  for d in slurmd slurmctld; do
    if is_running $d $d; then
      say "configuration changed; stopping $d"
      kill "$(<"$PIDS/$d.pid")"
      for ((i = 0; i < 60; i++)); do
        is_running $d $d || break
        sleep 0.25
      done
    fi
  done
  mv "$ROOT/slurm.conf.new" /etc/slurm/slurm.conf
  mv "$ROOT/gres.conf.new" /etc/slurm/gres.conf
else
  rm -f "$ROOT/slurm.conf.new" "$ROOT/gres.conf.new"
fi

# 4. accounting: a private MariaDB on 127.0.0.1:$DBPORT + slurmdbd ----------------------------
if [[ $ACCT == 1 ]]; then
  DB=$ROOT/mysql DBRUN=$ROOT/mysql-run
  install -d -o mysql -g mysql "$DB" "$DBRUN"
  if [[ ! -d $DB/mysql ]]; then
    say "initialising the MariaDB datadir"
    mariadb-install-db --no-defaults --user=mysql --datadir="$DB" \
      --auth-root-authentication-method=socket --skip-test-db >"$LOG/mysql-install.log" 2>&1 ||
      die "mariadb-install-db failed"
  fi
  start_daemon mariadbd mariadbd /usr/sbin/mariadbd --no-defaults --user=mysql \
    --datadir="$DB" --socket="$DBRUN/mysqld.sock" --pid-file="$DBRUN/mysqld.pid" \
    --bind-address=127.0.0.1 --port="$DBPORT" --skip-name-resolve \
    --innodb-buffer-pool-size=128M --innodb-log-file-size=64M \
    --innodb-lock-wait-timeout=900 --log-error="$DBRUN/mysqld.err"
  wait_for mariadb 60 mariadb-admin --no-defaults -S "$DBRUN/mysqld.sock" -u root ping
  mariadb --no-defaults -S "$DBRUN/mysqld.sock" -u root -e "
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurmci';
    CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurmci';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
  cat >"$ROOT/slurmdbd.conf.new" <<EOF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
DebugLevel=info
LogFile=$LOG/slurmdbd.log
PidFile=$ROOT/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DBPORT
StorageUser=slurm
StoragePass=slurmci
StorageLoc=slurm_acct_db
EOF
  install -m 600 "$ROOT/slurmdbd.conf.new" /etc/slurm/slurmdbd.conf
  rm -f "$ROOT/slurmdbd.conf.new"
  start_daemon slurmdbd slurmdbd /usr/sbin/slurmdbd -D
  wait_for slurmdbd 60 sacctmgr -n show cluster
  sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER" ||
    sacctmgr -i add cluster "$CLUSTER" >/dev/null
fi

# 5. slurmctld + slurmd -----------------------------------------------------------------------
start_daemon slurmctld slurmctld /usr/sbin/slurmctld -D -i
wait_for slurmctld 30 bash -c 'scontrol ping | grep -q "is UP"'
start_daemon slurmd slurmd /usr/sbin/slurmd -D -N "$NODE"

st=""
for ((i = 0; i < TIMEOUT; i++)); do
  st=$(sinfo -h -N -n "$NODE" -o %T 2>/dev/null || true)
  case $st in
    idle | mixed | allocated)
      say "node $NODE is $st ($CPUS CPUs, $GPUS fake GPUs declared; state in $ROOT)"
      exit 0
      ;;
    down* | drain* | fail* | inval*) if ((i % 10 == 5)); then scontrol update nodename="$NODE" state=resume || true; fi ;;
  esac
  sleep 1
done
die "node $NODE not idle after ${TIMEOUT}s (state: ${st:-?})"
