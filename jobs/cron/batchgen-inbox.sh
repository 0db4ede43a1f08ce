#!/usr/bin/env bash
# batchgen-inbox.sh - process the Parquet files that arrived in an inbox directory, incrementally.
#
#   batchgen-inbox.sh INBOX OUTROOT [HYDRA_OVERRIDE ...]
#   batchgen-inbox.sh /srv/inbox /srv/outbox model.path=/ckpt/qwen2.5-0.5b sampling.max_tokens=256
#
# Meant to be run by cron or a systemd timer (examples beside this script). Each INBOX/NAME.parquet gets its
# own output directory OUTROOT/NAME/ (keyed by the file name) and one `batchgen data.input=INBOX/NAME.parquet
# data.output=OUTROOT/NAME ...` run; the overrides are passed through unchanged ("$@", never eval'd).
#
# - Finished files are skipped without starting batchgen: OUTROOT/NAME/_manifest.json says "complete".
#   A file whose run was interrupted is resumed (batchgen continues from its manifest).
# - Files are taken in name order; hidden files (.NAME) and files modified in the last
#   BATCHGEN_INBOX_SETTLE_S seconds (default 10: maybe still being copied) wait for a later run. Best:
#   producers write elsewhere (or to .NAME) and `mv` into the inbox.
# - A file that batchgen rejects (exit 2: unreadable, wrong columns, or changed content under a name
#   already processed - give new data a new name) gets OUTROOT/NAME.failed with the message and is not
#   retried until the file changes. A file whose output is complete but has more error rows than
#   run.max_error_fraction (exit 3) gets NAME.failed too and counts as failed (its output stays). Other
#   failures are retried on the next run.
# - One run at a time: an exclusive lock on OUTROOT/.inbox.lock; a run that finds it taken exits 0 at once.
# - SIGTERM/SIGINT (systemd stop, shutdown) are forwarded to batchgen, which saves finished windows and
#   exits 75; this script then stops (status 75) and the next run resumes.
#
# Environment: BATCHGEN_BIN (default: `batchgen` on PATH; cron's PATH is minimal, so give the venv's path),
#   BATCHGEN_INBOX_SETTLE_S, BATCHGEN_INBOX_MAX_FILES (process at most this many files per run; 0 = all).
# Exit status: 0 all done (or another run holds the lock); 1 some file failed; 75 interrupted.
set -uo pipefail

if (($# < 2)); then
  echo "usage: $0 INBOX OUTROOT [HYDRA_OVERRIDE ...]" >&2
  exit 2
fi
INBOX=$1 OUTROOT=$2
shift 2
BIN=${BATCHGEN_BIN:-batchgen}
SETTLE=${BATCHGEN_INBOX_SETTLE_S:-10}
MAX_FILES=${BATCHGEN_INBOX_MAX_FILES:-0}
log() { echo "[batchgen-inbox $(date '+%F %T')] $*"; }

[[ -d $INBOX ]] || { log "inbox $INBOX is not a directory"; exit 2; }
mkdir -p "$OUTROOT" || exit 2
command -v "$BIN" >/dev/null || { log "batchgen not found ($BIN); set BATCHGEN_BIN"; exit 2; }
PY=$(dirname "$(command -v "$BIN")")/python
[[ -x $PY ]] || PY=python3

exec 9>>"$OUTROOT/.inbox.lock"
if ! flock -n 9; then
  log "another run holds $OUTROOT/.inbox.lock; nothing to do"
  exit 0
fi

child="" stop="" nsig=0
# shellcheck disable=SC2317  # called from the traps below
on_signal() {
  stop=$1
  nsig=$((nsig + 1))
  log "received SIG$1${child:+, forwarding to batchgen (pid $child)}"
  if [[ -n $child ]]; then kill -s "$1" "$child" 2>/dev/null || true; fi
}
trap 'on_signal TERM' TERM
trap 'on_signal INT' INT

# complete DIR: DIR/_manifest.json exists and lists every window.
complete() {
  local m=$1/_manifest.json
  [[ -f $m ]] &&
    "$PY" -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1])).get("complete") else 1)' \
      "$m" 2>/dev/null
}

shopt -s nullglob
now=$(date +%s)
done_n=0 skipped=0 failed=0 waiting=0 started=0
for f in "$INBOX"/*.parquet; do
  [[ -n $stop ]] && break
  [[ -f $f ]] || continue
  name=$(basename "$f" .parquet)
  out=$OUTROOT/$name
  if complete "$out"; then
    skipped=$((skipped + 1))
    continue
  fi
  if (($(stat -c %Y "$f") > now - SETTLE)); then
    log "$name: modified in the last ${SETTLE}s, leaving it for the next run"
    waiting=$((waiting + 1))
    continue
  fi
  if [[ -f $OUTROOT/$name.failed && ! $f -nt $OUTROOT/$name.failed ]]; then
    skipped=$((skipped + 1))
    continue
  fi
  if ((MAX_FILES > 0 && started >= MAX_FILES)); then
    waiting=$((waiting + 1))
    continue
  fi
  started=$((started + 1))
  log "$name: processing into $out"
  "$BIN" data.input="$f" data.output="$out" "$@" </dev/null >>"$OUTROOT/$name.log" 2>&1 &
  child=$!
  while :; do
    before=$nsig
    wait "$child"
    rc=$?
    ((nsig == before)) && break # batchgen exited (not a trap waking us up)
  done
  child=""
  case $rc in
    0)
      log "$name: done"
      rm -f "$OUTROOT/$name.failed"
      done_n=$((done_n + 1))
      ;;
    75)
      log "$name: interrupted; the next run resumes it (log: $OUTROOT/$name.log)"
      stop=${stop:-batchgen}
      ;;
    3)
      log "$name: finished with too many error rows (exit 3); see $OUTROOT/$name.log and $out/_report.json"
      tail -n 5 "$OUTROOT/$name.log" >"$OUTROOT/$name.failed"
      failed=$((failed + 1))
      ;;
    2)
      log "$name: rejected by batchgen (exit 2); not retried until the file changes (log: $OUTROOT/$name.log)"
      tail -n 5 "$OUTROOT/$name.log" >"$OUTROOT/$name.failed"
      failed=$((failed + 1))
      ;;
    *)
      log "$name: failed (exit $rc); retried next run (log: $OUTROOT/$name.log)"
      failed=$((failed + 1))
      ;;
  esac
done
log "finished $done_n, already done or skipped $skipped, waiting $waiting, failed $failed${stop:+, stopped by $stop}"
[[ -n $stop ]] && exit 75
((failed == 0)) || exit 1
exit 0
