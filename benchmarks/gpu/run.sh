#!/usr/bin/env bash
# The GPU benchmark in one run, sized for one lent H200 and at most 8 minutes:
#
#   bash benchmarks/gpu/run.sh              # on the GPU machine; OUT defaults to ./perf-out
#   bash benchmarks/gpu/run.sh --cpu-smoke  # the same script, presets shrunk to tiny CPU runs (< 2 min)
#   PERF_INSTALL=1 bash benchmarks/gpu/run.sh --cpu-smoke  # ... with the install step (the rehearsal)
#
# 1. installs the wheels carried in .whl/ (bash benchmarks/gpu/fetch_wheels.sh makes them); a failed
#    install stops the run;
# 2. preflight (<= 120 s: a cold machine loads the CUDA libraries slowly): Python, torch, CUDA, a C
#    compiler, every import our worker makes, free memory; a failure stops the run with one line,
#    before any benchmark. TRL failing to import skips only the TRL arms, a failed bitsandbytes round
#    trip only the 4-bit preset;
# 3. the decoding check: dynamic loop, static path and CUDA graph agree (a failed capture fails it);
#    their speed at 32 rows on the gpu-1.5b preset's model with its LoRA;
# 4. the presets, most valuable first, each worker under a fixed limit cut to the run's deadline
#    (benchmarks/perf.py); a worker prints its result after each measured step, so a cut keeps what it
#    measured: gpu-1.5b ours + TRL, gpu-0.5b ours + TRL, gpu-7b-qlora ours;
#    each preset's JSON is written under $OUT as soon as each of its workers ends;
# 5. one summary table, with the goals, printed and written to $OUT/summary.txt.
#
# Files under $OUT (and nothing else): run.log, preflight.json, decode_check.json, gpu-1.5b.json,
# gpu-0.5b.json, gpu-7b-qlora.json, summary.txt.
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

WHEELS=${WHEELS:-.whl}
if [[ $SMOKE == 0 || ${PERF_INSTALL:-0} == 1 ]] && compgen -G "$WHEELS/*.whl" > /dev/null; then
  SITE=${SITE:-/tmp/site}
  say "installing $(ls "$WHEELS"/*.whl | wc -l) carried wheels into $SITE"
  if ! $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHEELS"/*.whl >> "$LOG" 2>&1; then
    say "STOP: installing the carried wheels from $WHEELS/ failed (pip's output is in run.log)"; exit 2
  fi
  export PYTHONPATH="$SITE:$PYTHONPATH"
  # a version bound that involves a carried wheel: logged, not fatal (the preflight's imports decide);
  # the rehearsal (rehearse.sh) makes the same check fatal on the CPU
  CARRIED=$(ls "$WHEELS"/*.whl | xargs -n1 basename | cut -d- -f1 | sed 's/_/[-_]/g' | paste -sd'|')
  CONFLICTS=$($PY -m pip check 2>&1 | grep -iE "(^| )($CARRIED) " || true)
  if [[ -n $CONFLICTS ]]; then echo "$CONFLICTS" >> "$LOG"; say "pip check: carried wheels conflict (run.log)"; fi
fi

CPU_FLAG=$([[ $SMOKE == 1 ]] && echo --cpu || true)
PREFLIGHT_S=${PREFLIGHT_S:-120}
timeout --kill-after=5 "$PREFLIGHT_S" $PY benchmarks/gpu/preflight.py $CPU_FLAG --out "$OUT/preflight.json" \
  2>> "$LOG" | tee -a "$LOG"
if [[ ${PIPESTATUS[0]} != 0 ]]; then
  grep -q "preflight FAILED" "$LOG" || say "preflight FAILED: it did not finish in $PREFLIGHT_S s (see run.log)"
  say "STOP: preflight failed; no benchmark ran"; exit 2
fi
SKIP=$($PY -c 'import json, sys; print(" ".join(json.load(open(sys.argv[1])).get("skip", {})))' \
  "$OUT/preflight.json")

timeout --kill-after=5 $([[ $SMOKE == 1 ]] && echo 40 || echo 60) \
  $PY benchmarks/gpu/decode_check.py $CPU_FLAG --out "$OUT/decode_check.json" 2>> "$LOG" | tee -a "$LOG"
[[ ${PIPESTATUS[0]} == 0 ]] || say "decode check: FAILED (see decode_check.json and run.log); going on"

preset() {  # preset NAME ENGINES [NEEDS]: perf.py applies each worker's fixed limit, cut to the deadline
  local name=$1 engines=$2 needs=${3:-}
  if [[ -n $needs && " $SKIP " == *" $needs "* ]]; then say "$name: skipped, preflight: no $needs"; return; fi
  if [[ " $SKIP " == *" trl "* ]]; then engines=${engines/,trl/}; fi
  if (( $(date +%s) + 20 > DEADLINE )); then say "$name: skipped, the run's time is spent"; return; fi
  say "$name ($engines)"
  if [[ ${PERF_DRY_RUN:-0} == 1 ]]; then return; fi  # the plan only (tests/test_gpu_run.py)
  timeout --kill-after=5 $(( DEADLINE - $(date +%s) + 10 )) \
    $PY benchmarks/perf.py --preset "$name" --engines "$engines" --repetitions 1 --deadline "$DEADLINE" \
    $([[ $SMOKE == 1 ]] && echo --smoke) --out "$OUT/$name.json" --log "$LOG" 2>> "$LOG" | grep -v '^{' | tee -a "$LOG"
}
preset gpu-1.5b ours,trl
preset gpu-0.5b ours,trl
preset gpu-7b-qlora ours nf4

$PY benchmarks/gpu/summary.py "$OUT" > "$OUT/summary.txt" 2>> "$LOG"
cat "$OUT/summary.txt"
say "done; results in $OUT"
