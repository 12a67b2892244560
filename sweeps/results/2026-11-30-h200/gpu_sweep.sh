#!/usr/bin/env bash
# The H sweep at 20m on the GPU machine, from the repository root (carry .whl-sweep and .sweep-data).
set -uo pipefail
R=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-sweep/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . || exit 1
[ -f /tmp/w/data/stdlib/manifest.json ] || { mkdir -p /tmp/w/data && tar xJf .sweep-data/stdlib_data.tar.xz -C /tmp/w/data && mv /tmp/w/data/stdlib_data /tmp/w/data/stdlib; } || exit 1
cd /tmp/w   # outside the source tree, so the installed lit_mhar (with lit_mhar.sweeps) is the one imported
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, torch, triton, lightning; print(sys.version.split()[0], torch.__version__, triton.__version__, lightning.__version__)"
python3 -c "import lit_mhar.sweeps.runner, lit_mhar.sweeps.trial, mlflow, optuna, litdata, jsonargparse; print('imports ok')" || exit 1
DEFAULT_SPACE='[{scale: [20m], residual: [prenorm]}, {scale: [20m], residual: [delta], heads: [1, 2, 4, 8, 16]}]'
SPACE=${SPACE:-$DEFAULT_SPACE}
start=$SECONDS
timeout -s TERM "${SWEEP_TIMEOUT:-270}" python3 -m lit_mhar.cli sweep run --config "$R/sweeps/h_sweep.yaml" \
  --objective.tokens "${TOKENS:-8000000}" \
  --space "$SPACE" --study "${STUDY:-h_sweep_20m}" 2>&1
echo "sweep exit $? after $((SECONDS - start)) s"
python3 -m lit_mhar.cli sweep report --study "${STUDY:-h_sweep_20m}" --output_dir report 2>&1 | tail -3
tail -n 25 runs/sweeps/${STUDY:-h_sweep_20m}/trial-0001/trial.log
tar czf "$OUT/sweep.tgz" sweeps.db mlflow.db report runs/sweeps/${STUDY:-h_sweep_20m}/*/trial.log runs/sweeps/${STUDY:-h_sweep_20m}/*/trial.yaml runs/sweeps/${STUDY:-h_sweep_20m}/*/result.json
cat report/summary.md
