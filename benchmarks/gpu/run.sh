#!/usr/bin/env bash
# The GPU benchmark in one run, sized for one lent H200 and at most 8 minutes:
#
#   bash benchmarks/gpu/run.sh              # on the GPU machine; OUT defaults to ./perf-out
#   bash benchmarks/gpu/run.sh --cpu-smoke  # the same script, presets shrunk to tiny CPU runs (< 2 min)
#
# 1. installs the wheels carried in .whl/ (bash benchmarks/gpu/fetch_wheels.sh makes them); a failed
#    install stops the run;
# 2. preflight (<= 30 s): Python, torch, CUDA, a C compiler, every import a worker makes, free memory;
#    a failure stops the run with one line, before any benchmark;
# 3. the decoding check: dynamic loop, static path and CUDA graph agree; their speed at 32 rows;
# 4. the presets, most valuable first, each worker under a fixed time limit (benchmarks/perf.py):
#    gpu-1.5b ours + TRL, gpu-1.5b-8gib ours, gpu-0.5b ours + TRL, gpu-7b-qlora ours;
#    each preset's JSON is written under $OUT as soon as each of its workers ends;
# 5. one summary table, with the issue's goals, printed and written to $OUT/summary.txt.
#
# Files under $OUT (at most 8, as the device tool returns): run.log, preflight.json,
# decode_check.json, gpu-1.5b.json, gpu-1.5b-8gib.json, gpu-0.5b.json, gpu-7b-qlora.json, summary.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
SMOKE=0
if [[ "${1:-}" == "--cpu-smoke" ]]; then SMOKE=1; elif [[ -n "${1:-}" ]]; then
  echo "usage: bash benchmarks/gpu/run.sh [--cpu-smoke]" >&2; exit 2
fi
OUT=${OUT:-$PWD/perf-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
TOTAL_S=${PERF_TOTAL_S:-$([[ $SMOKE == 1 ]] && echo 110 || echo 470)}
START=$(date +%s)
DEADLINE=$(( START + TOTAL_S ))
LOG="$OUT/run.log"
: > "$LOG"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
say() { echo "[gpu-run +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }

if [[ $SMOKE == 0 ]] && compgen -G ".whl/*.whl" > /dev/null; then
  say "installing $(ls .whl/*.whl | wc -l) carried wheels"
  if ! $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl >> "$LOG" 2>&1; then
    say "STOP: installing the carried wheels from .whl/ failed (pip's output is in run.log)"; exit 2
  fi
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

CPU_FLAG=$([[ $SMOKE == 1 ]] && echo --cpu || true)
timeout --kill-after=5 30 $PY benchmarks/gpu/preflight.py $CPU_FLAG --out "$OUT/preflight.json" 2>> "$LOG" \
  | tee -a "$LOG"
if [[ ${PIPESTATUS[0]} != 0 ]]; then
  grep -q "preflight FAILED" "$LOG" || say "preflight FAILED: it did not finish in 30 s (see run.log)"
  say "STOP: preflight failed; no benchmark ran"; exit 2
fi

timeout --kill-after=5 $([[ $SMOKE == 1 ]] && echo 40 || echo 60) \
  $PY benchmarks/gpu/decode_check.py $CPU_FLAG --out "$OUT/decode_check.json" 2>> "$LOG" | tee -a "$LOG"
[[ ${PIPESTATUS[0]} == 0 ]] || say "decode check: failed or disagreed (see decode_check.json and run.log); going on"

preset() {  # preset NAME ENGINES: perf.py applies each worker's fixed limit, cut to the deadline
  local name=$1 engines=$2
  if (( $(date +%s) + 20 > DEADLINE )); then say "$name: skipped, the run's time is spent"; return; fi
  say "$name ($engines)"
  timeout --kill-after=5 $(( DEADLINE - $(date +%s) + 10 )) \
    $PY benchmarks/perf.py --preset "$name" --engines "$engines" --repetitions 1 --deadline "$DEADLINE" \
    $([[ $SMOKE == 1 ]] && echo --smoke) --out "$OUT/$name.json" --log "$LOG" 2>> "$LOG" | grep -v '^{' | tee -a "$LOG"
}
preset gpu-1.5b ours,trl
preset gpu-1.5b-8gib ours
preset gpu-0.5b ours,trl
preset gpu-7b-qlora ours

$PY benchmarks/gpu/summary.py "$OUT" > "$OUT/summary.txt" 2>> "$LOG"
cat "$OUT/summary.txt"
say "done; results in $OUT"
