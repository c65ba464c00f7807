#!/usr/bin/env bash
# The tests under load: the fast tier twice in a row, then the full tier's tests that start processes or use
# many devices at once, all while `stress --cpu N` (default 8) keeps N processes busy on this machine.
#
#     experiments/under_load.sh            # stress --cpu 8 (the Debian/Ubuntu package `stress`)
#     LOAD=16 experiments/under_load.sh    # another load
#
# What it shows: that no run aborts when the machine is oversubscribed (XLA:CPU's collectives wait for every
# device's thread; on a loaded machine one may start late, and before the tests raised XLA's time-out a
# process died with "Termination timeout ... only 6 of them arrived").  Each part's pytest summary, wall time
# and load average go to runs/under_load/<time>/summary.txt (git-ignored); the exit status is non-zero if a
# part failed or an XLA time-out was printed.
set -uo pipefail
cd "$(dirname "$0")/.."
LOAD="${LOAD:-8}"
PY="${PY:-.venv/bin/python}"
command -v stress >/dev/null || { echo "under_load: needs the program stress (apt-get install stress)"; exit 2; }
OUT="runs/under_load/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"

# The full tier's tests that start processes (several JAX processes, the launcher, checkpoints restored in a
# new process, the subprocess compile reproducers) or run a user's step on many devices.
SLOW_FILES=(
  tests/test_multiprocess.py tests/test_decoupled_multiprocess.py tests/test_decoupled_sharded.py
  tests/test_checkpoint.py tests/test_main_job_cli.py tests/test_xla_abort_repro.py tests/test_uniform_branches.py
  tests/test_user_step_2d.py tests/test_user_step_mesh3.py tests/test_user_step_own_jit.py
  tests/test_lm_sharded.py tests/test_diloco_inner_exchange.py
)

stress --cpu "$LOAD" >/dev/null 2>&1 &
STRESS=$!
RUN=""  # the running pytest's process group (its xdist workers and the processes its tests start)
cleanup() {
  [ -n "$RUN" ] && kill -- "-$RUN" 2>/dev/null
  kill "$STRESS" 2>/dev/null; pkill -P "$STRESS" 2>/dev/null
}
trap cleanup EXIT
trap 'echo "under_load: stopped" | tee -a "$SUMMARY"; exit 130' INT TERM
sleep 5
echo "under_load: stress --cpu $LOAD (pid $STRESS), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$SUMMARY"

failed=0
part() {  # part NAME ARGS...: one pytest run under the load, its summary line and time in the summary
  local name="$1"; shift
  local log="$OUT/$name.log" start=$SECONDS
  setsid "$PY" -m pytest -q "$@" >"$log" 2>&1 &  # a group of its own, stopped whole on Ctrl-C
  RUN=$!
  wait "$RUN"
  local status=$?
  RUN=""
  local took=$((SECONDS - start))
  local aborts
  aborts=$(grep -c "Termination timeout" "$log")
  echo "$name: exit $status, $(tail -n 1 "$log"), ${took} s, load average $(cut -d' ' -f1-3 /proc/loadavg), XLA time-outs: $aborts" | tee -a "$SUMMARY"
  if [ "$status" -ne 0 ] || [ "$aborts" -ne 0 ]; then failed=1; fi
}

part fast-tier-1
part fast-tier-2
part full-tier-processes --all -m slow "${SLOW_FILES[@]}"
[ "$failed" -eq 0 ] && echo "under_load: every part passed" | tee -a "$SUMMARY" || echo "under_load: FAILED" | tee -a "$SUMMARY"
exit "$failed"
