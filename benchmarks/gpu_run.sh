#!/usr/bin/env bash
# Run on the GPU machine, from the repository root, with the peers' wheels in .whl/:
#   OUT=results benchmarks/gpu_run.sh [tests] [op] [train] [SCALES...]
# installs lit_mhar and the peers under /tmp/site, runs the kernel tests (gpu marker included),
# the routing-op benchmark and the training benchmark; logs and CSV files go to $OUT.
set -uo pipefail
OUT=${OUT:?set OUT to a results folder}
mkdir -p "$OUT"
REPO=$(pwd)
steps=${STEPS:-"tests op train"}
scales=${SCALES:-"100m 350m 1b"}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/fla_core-*.whl .whl/liger_kernel-*.whl || exit 1
python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target /tmp/site . >/dev/null || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
cd /tmp  # outside the source tree, so that the installed lit_mhar (with lit_mhar.kernels) is imported
{
  date -u +%Y-%m-%dT%H:%MZ
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
  python3 -c "import fla, liger_kernel; from importlib.metadata import version as v; print('fla-core', v('fla-core'), 'liger-kernel', v('liger-kernel'))"
  git -C "$REPO" rev-parse --short HEAD 2>/dev/null || true
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if [[ " $steps " == *" tests "* ]]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest "$REPO/tests/kernels" -q -n 16 -p no:cacheprovider -x \
    -m "${TEST_MARK:-gpu or not gpu}" > "$OUT/tests.log" 2>&1
  echo "tests exit $?"; tail -5 "$OUT/tests.log"
fi
if [[ " $steps " == *" op "* ]]; then
  for s in $scales; do
    timeout ${OP_TIMEOUT:-200} python3 "$REPO/benchmarks/bench_routing_op.py" --scale "$s" --out "$OUT" >> "$OUT/op.log" 2>&1
    echo "op $s exit $?"
  done
fi
if [[ " $steps " == *" train "* ]]; then
  for s in $scales; do
    timeout ${TRAIN_TIMEOUT:-240} python3 "$REPO/benchmarks/bench_training.py" --scale "$s" --out "$OUT" >> "$OUT/train.log" 2>&1
    echo "train $s exit $?"
  done
fi
python3 "$REPO/benchmarks/report.py" "$OUT" || true
