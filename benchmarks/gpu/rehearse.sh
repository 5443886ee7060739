#!/usr/bin/env bash
# The GPU run rehearsed on this CPU, in a virtual environment that mirrors the GPU machine as closely
# as the package registries allow:
#
#   bash benchmarks/gpu/rehearse.sh          # or: make rehearse (.ci/run runs it after make test)
#
# 1. a venv with the machine image's libraries at its versions: transformers 5.17.0, accelerate 1.15.0,
#    huggingface_hub 1.33.0, tokenizers 0.23.2, safetensors 0.8.0, triton 3.6.0 (Liger-Kernel's wheel
#    requires it), and numpy, pyarrow, pandas, xxhash, requests, sympy, pyyaml, tensorboard; cached in
#    $REHEARSAL_VENV between runs;
# 2. the carried wheel set, the same pins as fetch_wheels.sh, installed exactly as run.sh installs it
#    (pip --no-index --no-deps --target, from the wheel folder), then `pip check` over the whole set:
#    a bound one wheel places on another, or on the image's packages, fails here, not on the GPU;
# 3. run.sh --cpu-smoke *with* its install step (every stage of both parts: the presets, the head-pass
#    comparison with the carried Liger wheel as its fifth arm, the decoding check), then the GPU-path unit
#    tests, in that venv; the time plans of both parts (run.sh's dry run) must fit their budgets.
#
# What it cannot mirror: the machine has Python 3.12 and torch 2.11 (CUDA 13); the only torch this
# machine can install offline is the 2.13 CPU wheel for Python 3.11, so the venv is Python 3.11 with
# torch 2.13 and the wheels are fetched for 3.11 (same versions); numpy is 2.4 (the machine's 2.5.2
# needs Python 3.12). The device's peft version is not
# recorded anywhere: the venv takes 0.21.2, the version this project's CI installs. CUDA graphs, bitsandbytes'
# CUDA library and the memory figures need the GPU itself.
#
# Its summary is the device run's: $OUT (default /tmp/grpo-rehearsal/out) holds the same files.
set -euo pipefail
cd "$(dirname "$0")/../.."
BASE=${REHEARSAL_DIR:-/tmp/grpo-rehearsal}
VENV=${REHEARSAL_VENV:-$BASE/venv}
export OUT=${OUT:-$BASE/out}
WHEELS=$BASE/wheels
SITE=$BASE/site
IMAGE=(torch==2.13.0 transformers==5.17.0 accelerate==1.15.0 huggingface_hub==1.33.0 tokenizers==0.23.2
       safetensors==0.8.0 triton==3.6.0 numpy pyarrow pandas xxhash requests sympy pyyaml tensorboard
       peft==0.21.2 pytest)
say() { echo "[rehearse] $*"; }
mkdir -p "$BASE"
if [[ ! -f $VENV/.image ]] || [[ "$(cat "$VENV/.image")" != "${IMAGE[*]}" ]]; then
  say "building the mirror venv in $VENV"
  rm -rf "$VENV"
  python3.11 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${IMAGE[@]}"
  echo "${IMAGE[*]}" > "$VENV/.image"
fi
PY=$VENV/bin/python
say "fetching the carried wheel set for Python 3.11 into $WHEELS"
rm -rf "$SITE" "$OUT"
DEST=$WHEELS WHEEL_PYTHON=3.11 PYTHON=$PY bash benchmarks/gpu/fetch_wheels.sh
say "checking the set against itself and the image (pip check)"
$PY -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl
if ! PYTHONPATH=$SITE $PY -m pip check > "$BASE/pip-check.txt" 2>&1; then
  cat "$BASE/pip-check.txt"; say "FAILED: the carried wheels and the image's packages conflict"; exit 1
fi
# grep reads the whole listing (grep -q would stop early and, under pipefail, unzip's SIGPIPE would fail it)
unzip -l "$WHEELS"/bitsandbytes-*.whl | grep 'libbitsandbytes_cuda130' > /dev/null \
  || { say "FAILED: the bitsandbytes wheel has no CUDA 13 library"; exit 1; }
rm -rf "$SITE"
say "the time plans (run.sh's dry run)"
for part in 1 2; do PERF_DRY_RUN=1 PYTHON=$PY bash benchmarks/gpu/run.sh --part $part | tail -n 1; done
say "run.sh --cpu-smoke with its install step"
PERF_INSTALL=1 WHEELS=$WHEELS SITE=$SITE PYTHON=$PY bash benchmarks/gpu/run.sh --cpu-smoke
# the carried Liger wheel ran as the head pass's fifth arm and agreed with the reference
$PY -c 'import json, sys; r = json.load(open(sys.argv[1])); sys.exit(not r["cases"] or not all(
    c["arms"].get("liger", {}).get("ok") for c in r["cases"]))' "$OUT/head_pass.json" \
  || { say "FAILED: Liger's arm of the head-pass comparison did not run or disagreed ($OUT/head_pass.json)"; exit 1; }
say "the GPU-path unit tests on transformers $(PYTHONPATH=$SITE $PY -c 'import transformers; print(transformers.__version__)')"
PYTHONPATH="$SITE:$PWD" $PY -m pytest -q -p no:cacheprovider tests/test_static_decode.py tests/test_decode.py \
  tests/test_vocab_tiled.py tests/test_logprobs.py tests/test_mixed_precision.py tests/test_low_vram.py \
  tests/test_sampler.py tests/test_trl_parity.py tests/test_benchmarks.py
say "ok: the summary is $OUT/summary.txt"
