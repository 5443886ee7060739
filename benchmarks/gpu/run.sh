#!/usr/bin/env bash
# GPU benchmark for a lent GPU (sized for one H200): grpo_engine vs TRL on the gpu-0.5b, gpu-1.5b and
# gpu-1.5b-8gib presets, and ours alone on gpu-7b-qlora. Each of our workers also reports the memory
# estimator's predicted peak (predicted_peak_mib, predicted_over_measured) for the +-15% check.
# Writes <preset>.json (full report), <preset>.log and env.txt under $OUT.
#
#   bash benchmarks/gpu/run.sh            # from the repository root; OUT defaults to ./perf-out
#
# Carried wheels in .whl/ (trl, accelerate, datasets, ... without torch) are installed first.
# The whole script ends within PERF_TOTAL_S seconds (default 420 = 7 minutes): each preset gets a
# share of the time left, perf.py starts no worker it cannot finish (--budget-s), and `timeout`
# kills the preset's whole process group if it still overruns.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/perf-out}
TOTAL_S=${PERF_TOTAL_S:-420}
START=$(date +%s)
mkdir -p "$OUT"

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, peft, trl; print('torch', torch.__version__, 'cuda', torch.version.cuda,
    'transformers', transformers.__version__, 'peft', peft.__version__, 'trl', trl.__version__)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

run_preset() {  # run_preset NAME PERCENT [ENGINES]: the preset gets PERCENT of the seconds left
  local name=$1 share=$2 engines=${3:-ours,trl}
  local left=$(( TOTAL_S - ($(date +%s) - START) - 20 ))
  local budget=$(( left * share / 100 ))
  if (( budget < 60 )); then
    echo "== $name: skipped, only ${budget}s left"
    return
  fi
  echo "== $name: budget ${budget}s"
  timeout --kill-after=5 $(( budget + 15 )) \
    python3 benchmarks/perf.py --preset "$name" --engines "$engines" --budget-s "$budget" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $? after $(( $(date +%s) - START ))s"
  tail -n 6 "$OUT/$name.log" | cut -c1-400
}

run_preset gpu-0.5b 25
run_preset gpu-1.5b 40
run_preset gpu-1.5b-8gib 45
run_preset gpu-7b-qlora 100 ours   # needs a CUDA bitsandbytes wheel in .whl/
echo "== done in $(( $(date +%s) - START ))s; results in $OUT"
