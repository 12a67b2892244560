#!/usr/bin/env bash
# One job of a sweep on the GPU machine (no network, at most 10 minutes a call), from the repository
# root, carrying .whl/ (jsonargparse, litdata, optuna, mlflow-skinny and what they need) and, from
# the second job on, .device-state/ (the state the last job returned). It installs, rebuilds the
# python corpus (the sweep checks it against the study's digest), resumes the study for SWEEP_SECONDS,
# stops it cleanly (interrupted trials run again next job), writes the report and returns the state:
#   OUT=... SWEEP="sweeps/map_20m.yaml sweeps/seed_spread_20m.yaml" SWEEP_SECONDS=420 SWEEP_ARGS="--trials_per_gpu 4" PARQUET_GB=1 \
#     bash benchmarks/device_sweep.sh
# Several sweep files run one after the other until SWEEP_SECONDS have passed; each one's study is
# the file's name (without .yaml).
# $OUT gets state.tgz (sweeps.db, mlflow.db, mlruns/, the trials' logs), report.tgz, env.txt,
# prepare.log, sweep.log and, with PARQUET_GB, prepare_speed.csv / .md.
set -uo pipefail
R=$PWD
OUT=${OUT:?}
: "${SWEEP:?}"
SWEEP_SECONDS=${SWEEP_SECONDS:-420}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . >/dev/null || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
W=/tmp/w
mkdir -p "$W"
[ -f "$R/.device-state/state.tgz" ] && tar -xzf "$R/.device-state/state.tgz" -C "$W"
cd "$W"
{
  date -u +%Y-%m-%dT%H:%MZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nproc
  python3 -c "import torch, triton, sys, lightning, optuna, mlflow, litdata; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'lightning', lightning.__version__, 'optuna', optuna.__version__, 'mlflow', mlflow.__version__, 'litdata', litdata.__version__)"
  git -C "$R" rev-parse --short HEAD 2>/dev/null
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
lit() { python3 -m lit_mhar.cli "$@"; }
if [ -n "${PARQUET_GB:-}" ]; then
  python3 "$R/benchmarks/prepare_speed.py" --workdir /tmp/ps --gigabytes "$PARQUET_GB" --shards 16 --out "$OUT" 2>&1 | tail -3
  echo "parquet benchmark done at $SECONDS s"
fi
if [ ! -f data/python/manifest.json ]; then
  ( time lit prepare --source python --output_dir data/python ) > "$OUT/prepare.log" 2>&1
  tail -8 "$OUT/prepare.log"
fi
echo "corpus ready at $SECONDS s"
end=$((SECONDS + SWEEP_SECONDS))
mkdir -p report
for sweep in $SWEEP; do
  study=$(basename "$sweep" .yaml)
  [ $SECONDS -lt $end ] || break
  setsid python3 -m lit_mhar.cli sweep run --config "$R/$sweep" ${SWEEP_ARGS:-} >> "$OUT/sweep.log" 2>&1 &
  pid=$!
  while kill -0 $pid 2>/dev/null && [ $SECONDS -lt $end ]; do sleep 5; done
  if kill -0 $pid 2>/dev/null; then
    kill -TERM -- -$pid 2>/dev/null   # the runner and its workers stop their trials and record them as interrupted
  fi
  for _ in $(seq 90); do pgrep -g $pid >/dev/null || break; sleep 1; done   # every process of the sweep, not only the runner
  pkill -KILL -g $pid 2>/dev/null
  wait $pid; echo "sweep $study exit $? at $SECONDS s"
  lit sweep report --study "$study" --output_dir "report/$study" --overwrite true 2>&1 | tail -2
done
grep -E "COMPLETE|FAIL|PRUNED|error|created|resuming|Traceback" "$OUT/sweep.log" | tail -40
tar -czf "$OUT/report.tgz" report
tar -czf "$OUT/state.tgz" --exclude='compile-cache' --exclude='*.ckpt' sweeps.db mlflow.db mlruns runs 2>/dev/null
ls -la "$OUT"
