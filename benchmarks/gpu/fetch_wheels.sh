#!/usr/bin/env bash
# Downloads the pinned wheels the GPU run needs and the GPU machine lacks, for its Python 3.12 on
# x86-64, into .whl/ (ignored by git; copy it to the GPU machine beside the checkout).
#
#   bash benchmarks/gpu/fetch_wheels.sh      # from the repository root, on a machine that reaches PyPI
#   WHEEL_PYTHON=3.11 DEST=/tmp/w bash benchmarks/gpu/fetch_wheels.sh  # the same pins for another Python
#                                                                         # (the rehearsal, rehearse.sh)
#
# The device image has torch 2.11 (CUDA 13.0), triton 3.6, transformers 5.17, peft, accelerate, pyarrow,
# pandas, xxhash, huggingface_hub 1.33, requests, sympy, typing-extensions and tensorboard; it lacks
# pydantic, math-verify, datasets, dill, multiprocess, TRL, bitsandbytes and Liger-Kernel (the head-pass
# comparison's fused GRPO loss; pure Python, 0.9 MiB, it needs the image's triton). Each is pinned with
# the versions of what it needs, so that `pip install --no-deps` of the set is complete. bitsandbytes is slimmed to its
# CUDA 13 and CPU libraries when the set would pass 60 MiB; the script fails if it still does.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${DEST:-.whl}
LIMIT_MIB=60
PY=${PYTHON:-python3}
WHEEL_PYTHON=${WHEEL_PYTHON:-3.12}  # the device's Python
WHEELS=(
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0
  math-verify==0.9.0 latex2sympy2-extended==1.11.0 antlr4-python3-runtime==4.13.2
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
  trl==1.16.0
  bitsandbytes==0.50.2
  liger-kernel==0.8.5
)
mkdir -p "$DEST"
rm -f "$DEST"/*.whl
$PY -m pip download --quiet --no-deps --only-binary=:all: --python-version "$WHEEL_PYTHON" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$DEST" "${WHEELS[@]}"
count=$(ls "$DEST"/*.whl | wc -l)
if (( count != ${#WHEELS[@]} )); then
  echo "fetch_wheels: expected ${#WHEELS[@]} wheels, got $count in $DEST" >&2; exit 1
fi
size_mib() { du -cm "$DEST"/*.whl | tail -n 1 | cut -f1; }
if (( $(size_mib) > LIMIT_MIB )); then
  $PY benchmarks/gpu/slim_wheel.py "$DEST"/bitsandbytes-*.whl \
    --drop 'bitsandbytes/libbitsandbytes_cuda1[0-2]*' --drop 'bitsandbytes/libbitsandbytes_rocm*' \
    --drop 'bitsandbytes/libbitsandbytes_xpu*'
fi
if (( $(size_mib) > LIMIT_MIB )); then
  echo "fetch_wheels: $DEST holds $(size_mib) MiB, over the ${LIMIT_MIB} MiB the device run may carry" >&2; exit 1
fi
echo "fetch_wheels: $count wheels, $(size_mib) MiB in $DEST"
