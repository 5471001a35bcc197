#!/usr/bin/env bash
# Every GPU claim comes from this script: build in place against the torch that is installed, run
# every test including the CUDA ones, run the soak and the benchmark suite. Logs, JSON and plots go to $OUT when
# it is set (the device tool), else to results/gpu_check.
# Usage: bash scripts/gpu_check.sh [--quick] [--no-tests | --no-bench] [--no-soak] [--only SECTION[,SECTION]]
#            [extra pytest args...]
# (--no-tests / --no-bench split one check into two calls when a call's time limit is short; --only and
# pytest args narrow a check to what a change touched, e.g.
#   bash scripts/gpu_check.sh --quick --no-soak --only training,budgets -m cuda tests/test_autograd.py)
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${OUT:-results/gpu_check}
mkdir -p "$DEST"
QUICK="" TESTS=1 BENCH=1 SOAK=1 ONLY=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK="--quick" ;;
    --no-tests) TESTS=0 ;;
    --no-bench) BENCH=0 ;;
    --no-soak) SOAK=0 ;;
    --only) ONLY=(--only "$2"); shift ;;
    *) break ;;
  esac
  shift
done
export PYTHONUNBUFFERED=1
summary="$DEST/summary.txt"
: > "$summary"
step() {  # step NAME LOG CMD...
  local name=$1 log=$2; shift 2
  local start=$(date +%s)
  "$@" > "$log" 2>&1
  local rc=$?
  printf '%-10s rc=%-3s %4ss  %s\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$(tail -1 "$log")" | tee -a "$summary"
  return $rc
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> "$summary" 2>&1 || true
step build "$DEST/build.log" env MAX_JOBS=$(nproc) bash scripts/setup_env.sh || { cat "$DEST/build.log"; cat build.log 2>/dev/null | tail -50; exit 1; }
python3 -m fastoffload_ext >> "$summary" 2>&1
# Error paths first: a build whose C++ exceptions crash the process would kill the test run midway.
python3 scripts/repro_errors.py >> "$summary" 2>&1
tests_rc=0 soak_rc=0 bench_rc=0
if [ $TESTS -eq 1 ]; then
  step tests /tmp/fastoffload_tests.log python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short --durations=8 "$@"
  tests_rc=$?
  # The device tool brings back at most 8 files: failures and skips go into the summary.
  grep -E "^(FAILED|ERROR|SKIPPED)" /tmp/fastoffload_tests.log >> "$summary"
  # The slowest tests, for whoever has to fit this script into a call's time limit.
  sed -n '/slowest .*durations/,/^$/p' /tmp/fastoffload_tests.log >> "$summary"
  [ $tests_rc -eq 0 ] || sed -n '/= FAILURES =/,/short test summary/p' /tmp/fastoffload_tests.log | tail -120 >> "$summary"
  # Soak: two offloaded models alternating with a third GPU thread, 1000 steps, drift figures.
  if [ $SOAK -eq 1 ]; then
    step soak /tmp/fastoffload_soak.log python3 scripts/soak.py --steps 1000 --check-every 100 --out "$DEST"
    soak_rc=$?
  fi
fi
if [ $BENCH -eq 1 ]; then
  # The device tool brings back at most 8 files: the suite's own results.txt holds its tables, so its
  # stdout stays on the machine (tail in the summary on failure).
  step bench /tmp/fastoffload_bench.log python3 -m benchmarks $QUICK "${ONLY[@]}" --no-progress --out "$DEST"
  bench_rc=$?
  [ $bench_rc -eq 0 ] || tail -30 /tmp/fastoffload_bench.log >> "$summary"
fi
cat "$summary"
exit $(( tests_rc != 0 || soak_rc != 0 || bench_rc != 0 ))
