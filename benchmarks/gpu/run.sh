#!/usr/bin/env bash
# The GPU benchmark in two runs on one lent GPU machine (an H200 or an H100), each under a time plan
# whose stage limits add up to the run's budget (tests/test_gpu_run.py sums them from the dry run):
#
#   bash benchmarks/gpu/run.sh --part 1     # <= 420 s, the install and the preflight included: gpu-0.5b
#                                           # (ours, then TRL), the head-pass comparison, gpu-1.5b ours,
#                                           # the decoding paths' agreement
#   bash benchmarks/gpu/run.sh --part 2     # <= 270 s: gpu-1.5b TRL, the 7B QLoRA preset
#   bash benchmarks/gpu/run.sh --cpu-smoke  # both parts in one go, shrunk to tiny CPU runs (make test)
#   PERF_INSTALL=1 bash benchmarks/gpu/run.sh --cpu-smoke  # ... with the install step (the rehearsal)
#   PERF_DRY_RUN=1 bash benchmarks/gpu/run.sh --part 1     # the plan: each stage and its limit; nothing runs
#
# Every stage runs under its limit (cut to the run's deadline), in this order, most valuable first:
# 1. install the wheels carried in .whl/ (bash benchmarks/gpu/fetch_wheels.sh makes them; skipped when the
#    same set is already installed, as on a machine the first run warmed); a failed install stops the run;
# 2. preflight: Python, torch, CUDA, a C compiler, every import the workers make, free memory, and the
#    machine's own ceilings (an 8192^3 bf16 matrix product, a device-to-device copy); a failure stops the
#    run with one line. TRL failing to import skips only the TRL arms, a failed bitsandbytes round trip
#    only the 4-bit preset, Liger only its head-pass arm;
# 3. the presets (benchmarks/perf.py), each worker under its preset's fixed limit: ours 1 warm-up (where
#    the decoding step compiles) + 2 measured steps, TRL 1 short warm-up + 1 measured; a worker prints its
#    result after each measured step, so a cut keeps what it measured; the JSON is written as each worker
#    ends. gpu-1.5b's two engines run in different parts (each part's gpu-1.5b.json holds one; table.py
#    --keep joins them, and judges the goals that need both);
# 4. part 1 also: the head-pass comparison (benchmarks/head_pass.py) after gpu-0.5b, and the decoding
#    paths' agreement last, on a tiny model whose compile is short, past one width bucket;
# 5. one summary with the goals, printed and written to $OUT/summary.txt.
# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for every process (both engines' workers alike).
#
# Files under $OUT (at most 8, what the device tool returns): run.log, timeline.jsonl (each stage's limit,
# start, end and exit status), preflight.json, the presets' <preset>.json, head_pass.json and
# decode_check.json (part 1), summary.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
SMOKE=0 PART=all
while [[ $# -gt 0 ]]; do
  case $1 in
    --cpu-smoke) SMOKE=1 ;;
    --part) PART=${2:-}; shift ;;
    *) echo "usage: bash benchmarks/gpu/run.sh [--part 1|2] [--cpu-smoke]" >&2; exit 2 ;;
  esac
  shift
done
if [[ $PART != 1 && $PART != 2 && ! ( $PART == all && $SMOKE == 1 ) ]]; then
  echo "run.sh: name the run, --part 1 or --part 2 (only --cpu-smoke runs both in one go)" >&2; exit 2
fi
DRY=${PERF_DRY_RUN:-0}
OUT=${OUT:-$PWD/perf-out}
[[ $DRY == 1 ]] || mkdir -p "$OUT"
PY=${PYTHON:-python3}
case $PART in 1) BUDGET=420 ;; 2) BUDGET=270 ;; *) BUDGET=690 ;; esac
TOTAL_S=${PERF_TOTAL_S:-$([[ $SMOKE == 1 ]] && echo 900 || echo $BUDGET)}
START=$(date +%s)
DEADLINE=$(( START + TOTAL_S ))
LOG="$OUT/run.log"
TIMELINE="$OUT/timeline.jsonl"
[[ $DRY == 1 ]] || : > "$LOG"
[[ $DRY == 1 ]] || : > "$TIMELINE"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
say() {
  local line="[gpu-run +$(( $(date +%s) - START ))s] $*"
  echo "$line"
  [[ $DRY == 1 ]] || echo "$line" >> "$LOG"
}
pick() { [[ $SMOKE == 1 ]] && echo "$2" || echo "$1"; }  # pick GPU_VALUE SMOKE_VALUE
# ends_in LIMIT: the epoch second by which a stage of LIMIT seconds starting now must have ended (3 s before
# its limit, and before the run's deadline), for the scripts that cut their workers' limits to it
ends_in() { local end=$(( $(date +%s) + $1 - 3 )); (( end > DEADLINE - 3 )) && end=$(( DEADLINE - 3 )); echo $end; }
PLANNED=0

# stage NAME LIMIT COMMAND...: COMMAND under LIMIT seconds (cut to the run's deadline), its output into
# run.log and on screen, one line in timeline.jsonl; returns its exit status (124: cut at the limit)
stage() {
  local name=$1 limit=$2
  shift 2
  PLANNED=$(( PLANNED + limit ))
  if [[ $DRY == 1 ]]; then echo "plan: $name $limit s"; return 0; fi
  local begin left rc
  begin=$(date +%s)
  left=$(( DEADLINE - begin ))
  (( limit > left )) && limit=$left
  if (( limit < 5 )); then
    say "$name: skipped, the run's time is spent"
    echo "{\"stage\": \"$name\", \"skipped\": true, \"start_s\": $(( begin - START ))}" >> "$TIMELINE"
    return 0
  fi
  say "$name (limit ${limit} s)"
  timeout --kill-after=2 $(( limit - 2 )) "$@" 2>> "$LOG" | grep --line-buffered -v '^{' | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  echo "{\"stage\": \"$name\", \"limit_s\": $limit, \"start_s\": $(( begin - START )), \"end_s\": $(( $(date +%s) - START )), \"rc\": $rc}" >> "$TIMELINE"
  return "$rc"
}

# install_wheels SITE WHEELS PYTHON (a script, so that `timeout` can run it): the carried wheels into SITE,
# unless the same set is there already
INSTALL='site=$1 wheels=$2 py=$3
listed=$(ls "$wheels"/*.whl | xargs -n1 basename | sort | paste -sd" ")
if [[ -f $site/.carried && "$(cat "$site/.carried")" == "$listed" ]]; then
  echo "install: the same $(ls "$wheels"/*.whl | wc -l) wheels are already in $site"; exit 0
fi
echo "installing $(ls "$wheels"/*.whl | wc -l) carried wheels into $site"
"$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl \
  && echo "$listed" > "$site/.carried"'

WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/site}
if [[ $SMOKE == 0 || ${PERF_INSTALL:-0} == 1 ]] && { [[ $DRY == 1 ]] || compgen -G "$WHEELS/*.whl" > /dev/null; }; then
  if ! stage install "$(pick 10 60)" bash -c "$INSTALL" install_wheels "$SITE" "$WHEELS" "$PY"; then
    say "STOP: installing the carried wheels from $WHEELS/ failed (pip's output is in run.log)"; exit 2
  fi
  export PYTHONPATH="$SITE:$PYTHONPATH"
  if [[ $DRY == 0 ]]; then
    # a version bound that involves a carried wheel: logged, not fatal (the preflight's imports decide);
    # the rehearsal (rehearse.sh) makes the same check fatal on the CPU
    CARRIED=$(ls "$WHEELS"/*.whl | xargs -n1 basename | cut -d- -f1 | sed 's/_/[-_]/g' | paste -sd'|')
    CONFLICTS=$($PY -m pip check 2>&1 | grep -iE "(^| )($CARRIED) " || true)
    if [[ -n $CONFLICTS ]]; then echo "$CONFLICTS" >> "$LOG"; say "pip check: carried wheels conflict (run.log)"; fi
  fi
fi

CPU_FLAG=$([[ $SMOKE == 1 ]] && echo --cpu || true)
QUICK=$([[ $PART == 2 ]] && echo --quick || true)
stage preflight "$(pick $([[ $PART == 2 ]] && echo 40 || echo 50) 90)" \
  $PY benchmarks/gpu/preflight.py $CPU_FLAG $QUICK --out "$OUT/preflight.json"
if [[ $? != 0 ]]; then
  grep -q "preflight FAILED" "$LOG" || say "preflight FAILED: it did not finish within its limit (see run.log)"
  say "STOP: preflight failed; no benchmark ran"; exit 2
fi
SKIP=$([[ $DRY == 1 ]] || $PY -c 'import json, sys; print(" ".join(json.load(open(sys.argv[1])).get("skip", {})))' \
  "$OUT/preflight.json")

preset() {  # preset NAME ENGINES [NEEDS]: the stage's limit is its workers' fixed limits + 5 s for the parent
  local name=$1 engines=$2 needs=${3:-} limit
  if [[ -n $needs && " $SKIP " == *" $needs "* ]]; then say "$name: skipped, preflight: no $needs"; return; fi
  if [[ " $SKIP " == *" trl "* ]]; then
    engines=${engines/,trl/}
    [[ $engines == trl ]] && { say "$name (trl): skipped, preflight: no trl"; return; }
  fi
  if [[ ${PERF_PREFLIGHT_ONLY:-0} == 1 ]]; then say "$name ($engines)"; return; fi  # tests/test_gpu_run.py
  local smoke=$([[ $SMOKE == 1 ]] && echo --smoke)
  limit=$($PY benchmarks/perf.py --preset "$name" --engines "$engines" $smoke --stage-limit) || return
  stage "$name$([[ $engines == ours,trl ]] || echo "/$engines")" "$limit" $PY benchmarks/perf.py --preset "$name" --engines "$engines" --repetitions 1 \
    --deadline "$(ends_in "$limit")" --preflight "$OUT/preflight.json" $smoke --out "$OUT/$name.json" \
    --log "$LOG"
}

head_pass() {
  if [[ ${PERF_PREFLIGHT_ONLY:-0} == 1 ]]; then say "head-pass"; return; fi
  local limit
  limit=$(pick 55 120)
  stage head-pass "$limit" $PY benchmarks/head_pass.py $([[ $SMOKE == 1 ]] && echo --smoke) \
    --deadline "$(ends_in "$limit")" --out "$OUT/head_pass.json" --log "$LOG" \
    || say "head pass: an arm disagreed or the worker failed (see head_pass.json); going on"
}

decode() {  # decode PART GPU_LIMIT SMOKE_LIMIT [ARGS...]
  if [[ ${PERF_PREFLIGHT_ONLY:-0} == 1 ]]; then say "decode-$1"; return; fi
  local part=$1 limit
  limit=$(pick "$2" "$3")
  shift 3
  stage "decode-$part" "$limit" $PY benchmarks/gpu/decode_check.py $CPU_FLAG --part "$part" "$@" \
    --out "$OUT/decode_check.json" || say "decode check: FAILED (see decode_check.json and run.log); going on"
}

case $PART in
  1) preset gpu-0.5b ours,trl; head_pass; preset gpu-1.5b ours
     decode agreement 25 90 --shape smoke --new-tokens 160 ;;
  2) preset gpu-1.5b trl; preset gpu-7b-qlora ours nf4 ;;
  all) preset gpu-0.5b ours,trl; head_pass; preset gpu-1.5b ours,trl; preset gpu-7b-qlora ours nf4
       decode all 20 90 ;;
esac

if [[ $DRY == 1 ]]; then
  PLANNED=$(( PLANNED + 5 ))
  echo "plan: summary 5 s"
  echo "plan: part $PART adds up to $PLANNED s of its $TOTAL_S s"
  (( PLANNED <= TOTAL_S )); exit $?
fi
stage summary "$(pick 5 30)" sh -c "$PY benchmarks/gpu/summary.py '$OUT' > '$OUT/summary.txt'"
cat "$OUT/summary.txt"
say "done; results in $OUT"
