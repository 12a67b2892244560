#!/usr/bin/env bash
# One call on the one-GPU machine, from the repository root, carrying .whl/ (fla-core, liger-kernel):
# GPU kernel tests, generation at 350m, then per scale in $SCALES the routing op against its peers,
# training throughput, tile tuning, the tensors alive at a step's peak memory (memory_phases.py --trace), the host's
# time per step (host_profile.py), a profile, and the DRAM bytes of every kernel of one step (step_bytes.py, Nsight Compute),
# and training through lit-mhar fit itself (bench_fit.py, once, after the scales).
#   OUT=... SCALES="350m" STEPS="tests ncu tune_decode generate op train tune memory host profile bytes fit" bash benchmarks/device_kernels.sh
set -uo pipefail
R=$PWD
OUT=${OUT:?}
SCALES=${SCALES:-350m}
STEPS=${STEPS:-"tests op train profile"}
TRAIN_VARIANTS=${TRAIN_VARIANTS:-prenorm,mhar-block8-H8,delta-block8-H8,mhar-full-H8,delta-full-H8}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/fla_core-*.whl .whl/liger_kernel-*.whl || exit 1
python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target /tmp/site . >/dev/null || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
cd /tmp
{
  date -u +%Y-%m-%dT%H:%MZ
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
  git -C "$R" rev-parse --short HEAD 2>/dev/null; git -C "$R" status --short 2>/dev/null | head
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if [[ " $STEPS " == *" tests "* ]]; then
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest $(for f in ${TEST_FILES:-tests/kernels}; do echo "$R/$f"; done) -q -n ${TEST_WORKERS:-8} -p no:cacheprovider -m "${TEST_MARK:-gpu or not gpu}" -k "${TEST_K:-}" \
    > "$OUT/tests.log" 2>&1; echo "tests exit $? at $SECONDS s"; grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -15
fi
if [[ " $STEPS " == *" ncu "* ]]; then
  (cd "$R/benchmarks" && timeout ${NCU_TIMEOUT:-240} ncu -k regex:"_route|_decode" --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats --section ComputeWorkloadAnalysis --section InstructionStats --csv --page details \
    python3 ncu_kernels.py --scale 350m > "$OUT/ncu.csv" 2> "$OUT/ncu.err")
  echo "ncu exit $? at $SECONDS s"; tail -n 3 "$OUT/ncu.err"; wc -l "$OUT/ncu.csv"
fi
if [[ " $STEPS " == *" tune_decode "* ]]; then
  timeout ${TUNE_DECODE_TIMEOUT:-300} python3 "$R/benchmarks/tune_decode.py" --scale 350m --out "$OUT" > "$OUT/tune_decode.log" 2>&1
  echo "tune_decode exit $? at $SECONDS s"; tail -n 2 "$OUT/tune_decode.log"
fi
if [[ " $STEPS " == *" generate "* ]]; then
  timeout ${GENERATE_TIMEOUT:-300} python3 "$R/benchmarks/bench_generate.py" ${GENERATE_ARGS:---scale 350m --compile} --out "$OUT" > "$OUT/generate.log" 2>&1
  echo "generate exit $? at $SECONDS s"; cat "$OUT/generate_bench.md" 2>/dev/null || tail -n 30 "$OUT/generate.log"
fi
for s in $SCALES; do
  if [[ " $STEPS " == *" op "* ]]; then
    timeout ${OP_TIMEOUT:-100} python3 "$R/benchmarks/bench_routing_op.py" --scale $s --variants ${OP_VARIANTS:-triton,fla,liger} --out "$OUT" >> "$OUT/op.log" 2>&1
    echo "op $s exit $? at $SECONDS s"
  fi
  if [[ " $STEPS " == *" train "* ]]; then
    timeout ${TRAIN_TIMEOUT:-200} python3 "$R/benchmarks/bench_training.py" --scale $s --variants $TRAIN_VARIANTS --out "$OUT" >> "$OUT/train.log" 2>&1
    echo "train $s exit $? at $SECONDS s"; grep "resident programs" "$OUT/train.log" | sort -u | tail -n 8
  fi
  if [[ " $STEPS " == *" tune "* ]]; then
    timeout ${TUNE_TIMEOUT:-220} python3 "$R/benchmarks/tune_tiles.py" --scale $s ${TUNE_ARGS:-} --out "$OUT" > "$OUT/tune-$s.log" 2>&1
    echo "tune $s exit $? at $SECONDS s"
  fi
  if [[ " $STEPS " == *" memory "* ]]; then
    timeout ${MEMORY_TIMEOUT:-150} python3 "$R/benchmarks/memory_phases.py" --scale $s --variants ${MEMORY_VARIANTS:-prenorm,mhar-block8-H8,delta-block8-H8} --trace --out "$OUT" > "$OUT/memory-$s.log" 2>&1
    echo "memory $s exit $? at $SECONDS s"; cat "$OUT/memory_phases.csv"
  fi
  if [[ " $STEPS " == *" host "* ]]; then
    (cd "$R/benchmarks" && timeout ${HOST_TIMEOUT:-200} python3 host_profile.py --scale $s --variants ${HOST_VARIANTS:-prenorm,mhar-block8-H8,delta-block8-H8} --out "$OUT") > "$OUT/host-$s.log" 2>&1
    echo "host $s exit $? at $SECONDS s"; head -n 8 "$OUT/host_profile_$s.md" 2>/dev/null || tail -n 20 "$OUT/host-$s.log"
  fi
  if [[ " $STEPS " == *" profile "* ]]; then
    timeout ${PROFILE_TIMEOUT:-120} python3 "$R/benchmarks/profile_step.py" --scale $s --variants ${PROFILE_VARIANTS:-prenorm,mhar-block8-H8,mhar-full-H8} --out "$OUT" > "$OUT/profile-$s.log" 2>&1
    echo "profile $s exit $? at $SECONDS s"
  fi
done
if [[ " $STEPS " == *" bytes "* ]]; then  # DRAM bytes and time of every kernel of one step (step_bytes.py), per scale and variant
  python3 "$R/benchmarks/step_bytes.py" copy --out "$OUT" > "$OUT/bytes.log" 2>&1
  for s in ${BYTES_SCALES:-350m}; do
    for v in $(echo ${BYTES_VARIANTS:-prenorm,mhar-block8-H8,mhar-full-H8,delta-block8-H8,delta-full-H8} | tr ',' ' '); do
      (cd "$R/benchmarks" && timeout ${BYTES_TIMEOUT:-150} ncu --target-processes application-only --profile-from-start off --clock-control none --csv --page raw --print-units base \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum -k regex:"${BYTES_KERNELS:-_route|triton_|elementwise|reduce|Functor|multi_tensor|vectorized|unrolled|norm|copy}" \
        python3 step_bytes.py step --scale $s --variant $v > "$OUT/ncu_bytes_${s}_${v}.csv" 2>> "$OUT/bytes.log")
      echo "bytes $s $v exit $? at $SECONDS s"
    done
  done
  python3 "$R/benchmarks/step_bytes.py" report --out "$OUT" > "$OUT/bytes_report.log" 2>&1; echo "bytes report exit $?"; grep -A12 "^### " "$OUT/step_bytes.md" | grep -E "^###|all profiled|routing" | head -40
fi
if [[ " $STEPS " == *" fit "* ]]; then  # lit-mhar fit itself (bench_fit.py); the default corpus is built in /tmp/data first
  # the CLI's dependencies the machine lacks (wheels of jsonargparse, litdata, mlflow and theirs, in .whl/);
  # a 350m fit of 100 steps takes about 270 s on a fresh machine (compiling, saving the checkpoint): one config per call
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$R"/.whl/*.whl > "$OUT/fit_install.log" 2>&1 || tail -n 5 "$OUT/fit_install.log"
  timeout ${FIT_TIMEOUT:-400} python3 "$R/benchmarks/bench_fit.py" --configs "$(echo ${FIT_CONFIGS:-configs/350m/prenorm.yaml} | tr ',' '\n' | sed "s|^|$R/|" | paste -sd,)" \
    --steps ${FIT_STEPS:-100} --out "$OUT/fit" -- ${FIT_ARGS:---model.compile true} > "$OUT/fit.log" 2>&1
  echo "fit exit $? at $SECONDS s"; cat "$OUT/fit/fit_bench.csv" 2>/dev/null || tail -n 20 "$OUT/fit.log"
fi
python3 - "$OUT" <<'PY'
import csv, os, sys
out = sys.argv[1]
for name, cols in (("op_bench.csv", ["scale", "N", "H", "variant", "status", "fwd_ms", "bwd_ms", "both_ms", "fwd_frac_copy", "bwd_frac_copy", "err_out", "err_dsrc", "err_dq"]),
                   ("train_bench.csv", ["scale", "variant", "status", "tokens_per_s", "ratio_vs_prenorm", "step_ms", "host_ms", "mfu_datasheet", "peak_mem_GiB", "mem_ratio_vs_prenorm", "note"])):
    p = os.path.join(out, name)
    if os.path.exists(p):
        print(name)
        for r in csv.DictReader(open(p)):
            print("  " + " ".join(f"{c}={r.get(c, '')}" for c in cols))
PY
for s in $SCALES; do head -c 1500 "$OUT/profile_$s.md" 2>/dev/null; done
echo "done at $SECONDS s"
# the machine returns at most 8 files: everything but env.txt goes back as one archive
tar czf /tmp/results.tgz -C "$OUT" . && find "$OUT" -type f ! -name env.txt -delete && mv /tmp/results.tgz "$OUT/"
