#!/usr/bin/env bash
# stop-slurm.sh - undo start-slurm.sh: cancel every job, then stop the daemons that start-slurm.sh
# started, by the PIDs it recorded under $BATCHGEN_SLURM_ROOT/pids (each checked against
# /proc/PID/stat first, so a recycled PID is never signalled). Always exits 0.
# BATCHGEN_SLURM_WIPE=1 also deletes the state dir (job ids, accounting database, logs).
set -uo pipefail
ROOT=${BATCHGEN_SLURM_ROOT:-/tmp/batchgen-slurm}
PIDS=$ROOT/pids
say() { echo "[stop-slurm +${SECONDS}s] $*"; }
alive() { # our pidfile names a live, non-zombie process whose comm is $1
  local pid c st
  [[ -s $PIDS/$1.pid ]] || return 1
  pid=$(<"$PIDS/$1.pid")
  read -r _ c st _ 2>/dev/null <"/proc/$pid/stat" || return 1
  [[ $c == "($1)" && $st != Z ]]
}

if alive slurmctld && [[ -n $(squeue -h -o %i 2>/dev/null) ]]; then
  say "cancelling jobs: $(squeue -h -o %i | tr '\n' ' ')"
  # shellcheck disable=SC2046  # one word per job id
  scancel $(squeue -h -o %A | sort -u) 2>/dev/null || true
  for ((i = 0; i < 60; i++)); do
    [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break
    sleep 0.5
  done
fi
for d in slurmd slurmctld slurmdbd mariadbd munged; do
  if alive $d; then
    pid=$(<"$PIDS/$d.pid")
    kill -TERM "$pid"
    for ((i = 0; i < 60; i++)); do
      alive $d || break
      sleep 0.25
    done
    if alive $d; then
      say "$d ($pid) ignored SIGTERM; SIGKILL"
      kill -KILL "$pid"
    fi
    say "stopped $d ($pid)"
  fi
  rm -f "$PIDS/$d.pid"
done
if [[ ${BATCHGEN_SLURM_WIPE:-0} == 1 && -d $ROOT ]]; then
  rm -rf -- "$ROOT"
  say "removed $ROOT"
fi
exit 0
