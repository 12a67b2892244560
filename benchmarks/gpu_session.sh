#!/usr/bin/env bash
# One call on the two-GPU machine, from the repository root, carrying .whl-sweep/ (jsonargparse,
# litdata, optuna, mlflow and what they import that the image lacks) and .sweep-data/ (the default
# corpus, prepared on a CPU machine, as stdlib_data.tar.xz). Results go to $OUT.
#
#   MODE=sweep-generate  the comparison / H sweep at 20m: two sweep commands on GPU 0 while
#                        benchmarks/bench_generate.py (350m) runs alone on GPU 1; when it ends, two
#                        more sweep commands on GPU 1. All four share one sqlite study.
#   MODE=sweep           four sweep commands, two per GPU (resumes a study carried in .sweep-state/).
#   MODE=final           bench_generate (350m) on GPU 1 beside bench_ddp control on GPU 0, then block MHAR
#                        scaling and resume on both GPUs.
#   MODE=ddp             benchmarks/bench_ddp.py parity, scaling and resume at 350m on both GPUs.
#
# At most 8 files come back from $OUT: each mode tars its folders.
# DEADLINE (s, default 560): the ddp mode's steps share it (parity, scaling, resume).
# SWEEP_TIMEOUT (s) stops the sweep commands; a stopped study resumes from .sweep-state/ next call.
set -uo pipefail
R=$PWD
OUT=${OUT:?}
MODE=${MODE:-sweep-generate}
STUDY=${STUDY:-gpu20m}
TOKENS=${TOKENS:-10485760}
SPACE=${SPACE:-'[{scale: [20m], residual: [prenorm, hyper], seed: [0, 1]},
 {scale: [20m], residual: [attnres], heads: [1, 2, 4, 8, 16], seed: [0, 1]},
 {scale: [20m], residual: [delta], heads: [1], seed: [0, 1]},
 {scale: [20m], residual: [attnres], heads: [1, 8], block_size: [2], seed: [0, 1]},
 {scale: [20m], residual: [delta], heads: [8], block_size: [2], seed: [0, 1]}]'}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-sweep/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target /tmp/site . >/dev/null || exit 1
mkdir -p /tmp/w/data && tar xJf .sweep-data/stdlib_data.tar.xz -C /tmp/w/data && mv /tmp/w/data/stdlib_data /tmp/w/data/stdlib || exit 1
[ -d .sweep-state ] && cp .sweep-state/*.db /tmp/w/ 2>/dev/null
cd /tmp/w   # outside the source tree, so the installed lit_mhar (with kernels, cli, sweeps) is imported
{
  date -u +%Y-%m-%dT%H:%MZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, torch, triton, lightning; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'lightning', lightning.__version__, 'cuda', torch.version.cuda)"
  git -C "$R" rev-parse --short HEAD 2>/dev/null || true
  nproc
} | tee "$OUT/env.txt"

sweep() {  # sweep GPU TAG
  CUDA_VISIBLE_DEVICES=$1 timeout -s TERM "${SWEEP_TIMEOUT:-480}" python3 -m lit_mhar.cli sweep run \
    --config "$R/sweeps/compare.yaml" --study "$STUDY" --objective.tokens "$TOKENS" --space "$SPACE" \
    > "$OUT/sweep-$2.log" 2>&1
  echo "sweep $2 exit $? at $SECONDS s"
}

finish_sweep() {
  python3 -m lit_mhar.cli sweep report --study "$STUDY" --output_dir report > "$OUT/report.log" 2>&1
  tar czf "$OUT/sweep.tgz" sweeps.db mlflow.db report runs/sweeps/$STUDY/*/trial.log runs/sweeps/$STUDY/*/trial.yaml \
    runs/sweeps/$STUDY/*/result.json 2>/dev/null
  cat report/summary.md 2>/dev/null || tail -20 "$OUT/report.log"
}

case $MODE in
  sweep-generate)
    sweep 0 a & sleep 20; sweep 0 b &
    CUDA_VISIBLE_DEVICES=1 timeout 300 python3 "$R/benchmarks/bench_generate.py" --scale 350m --compile --out "$OUT" \
      > "$OUT/generate.log" 2>&1
    echo "generate exit $? at $SECONDS s"; tail -n 20 "$OUT/generate.log"
    sweep 1 c & sleep 20; sweep 1 d &
    wait
    finish_sweep ;;
  sweep)
    sweep 0 a & sleep 15; sweep 0 b & sleep 15; sweep 1 c & sleep 15; sweep 1 d &
    wait
    finish_sweep ;;
  ddp)
    tail_logs() { tail -n 4 "$OUT"/ddp-*.log; }
    B="$R/benchmarks/bench_ddp.py"
    timeout $(( ${DEADLINE:-560} - SECONDS - 320 )) python3 "$B" parity --config "$R/configs/350m/block_mhar.yaml" --devices 2 --global_batch 32 --steps 50 --out "$OUT/ddp" \
      > "$OUT/ddp-parity.log" 2>&1; echo "parity exit $? at $SECONDS s"
    timeout $(( ${DEADLINE:-560} - SECONDS - 150 )) python3 "$B" scaling --config "$R/configs/350m/prenorm.yaml" "$R/configs/350m/block_mhar.yaml" --devices 2 --steps 60 \
      --log_every 10 --out "$OUT/ddp" > "$OUT/ddp-scaling.log" 2>&1; echo "scaling exit $? at $SECONDS s"
    timeout $(( ${DEADLINE:-560} - SECONDS )) python3 "$B" resume --config "$R/configs/350m/block_mhar.yaml" --devices 2 --steps 10 --out "$OUT/ddp" \
      > "$OUT/ddp-resume.log" 2>&1; echo "resume exit $? at $SECONDS s"
    tail_logs
    find "$OUT/ddp" -name '*.ckpt' -delete; rm -f "$OUT/ddp/batches.pt"
    cp "$OUT/ddp/ddp.md" "$OUT/" 2>/dev/null
    tar czf "$OUT/ddp.tgz" -C "$OUT" ddp ddp-parity.log ddp-scaling.log ddp-resume.log && rm -rf "$OUT/ddp" "$OUT"/ddp-*.log
    cat "$OUT/ddp.md" 2>/dev/null ;;
  final)  # generate (350m) on GPU 1 beside the parity control on GPU 0; then block MHAR scaling; then resume
    B="$R/benchmarks/bench_ddp.py"
    CUDA_VISIBLE_DEVICES=1 timeout 200 python3 "$R/benchmarks/bench_generate.py" --scale 350m --compile --out "$OUT" \
      > "$OUT/generate.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=0 timeout 200 python3 "$B" control --config "$R/configs/350m/block_mhar.yaml" --global_batch 32 --steps 50 \
      --out "$OUT/ddp" > "$OUT/ddp-control.log" 2>&1; echo "control exit $? at $SECONDS s"
    wait; echo "generate done at $SECONDS s"
    timeout $(( ${DEADLINE:-540} - SECONDS - 120 )) python3 "$B" scaling --config "$R/configs/350m/block_mhar.yaml" --devices 2 --steps 60 \
      --log_every 10 --out "$OUT/ddp" > "$OUT/ddp-scaling.log" 2>&1; echo "scaling exit $? at $SECONDS s"
    timeout $(( ${DEADLINE:-540} - SECONDS )) python3 "$B" resume --config "$R/configs/350m/block_mhar.yaml" --devices 2 --steps 10 \
      --out "$OUT/ddp" > "$OUT/ddp-resume.log" 2>&1; echo "resume exit $? at $SECONDS s"
    grep -h "^{" "$OUT"/ddp-*.log
    find "$OUT/ddp" -name '*.ckpt' -delete; rm -f "$OUT/ddp/batches.pt"
    tar czf "$OUT/ddp.tgz" -C "$OUT" ddp ddp-control.log ddp-scaling.log ddp-resume.log generate.log && rm -rf "$OUT/ddp" "$OUT"/ddp-*.log
    cat "$OUT/generate_bench.md" 2>/dev/null || tail -n 30 "$OUT/generate.log" ;;
esac
echo "done at $SECONDS s"
