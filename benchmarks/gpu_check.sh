#!/usr/bin/env bash
# The GPU-host checks of issue 12 (item 5), prepared but NOT RUN YET: no GPU
# machine has been available. Run it from any directory on a host with NVIDIA
# GPUs, in an environment with `pip install -e '.[gpu,bench]'`:
#
#   benchmarks/gpu_check.sh                 # about 10-15 minutes
#   PYTHON=.venv/bin/python OUT_DIR=/tmp/gpu benchmarks/gpu_check.sh
#
# It runs, each bounded by STEP_TIMEOUT seconds (default 600), with its full
# output in $OUT_DIR/<name>.log (default benchmarks/results/gpu/):
#   main                 the README's main job (digits, AdaGrad, 2 workers, 2 ps);
#   downpour             Downpour SGD (n_fetch = n_push = 4) on the speech model;
#   model_parallel_job   the speech model split over 2 GPUs per replica
#                        (--devices_per_replica=2: on GPUs when each worker
#                        has 2, i.e. 4+ GPUs; on a host with fewer the workers
#                        share GPUs and replicas split over CPU devices);
#   model_parallel_bench benchmarks/model_parallel_bench.py (partitions go to
#                        GPUs when the process sees any; figure + CSV);
#   downpour_bench       benchmarks/downpour_bench.py --quick (figures + CSV).
# While the jobs run, `nvidia-smi --query-compute-apps` is sampled every 2 s
# into $OUT_DIR/nvidia_smi_apps.csv: each worker process should appear on its
# own GPU(s) only, the ps processes on none (the "local cluster GPUs:" line of
# each job prints the assignment).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT_DIR=${OUT_DIR:-benchmarks/results/gpu}
STEP_TIMEOUT=${STEP_TIMEOUT:-600}
mkdir -p "$OUT_DIR"
failed=0

step() {
  local name=$1
  shift
  echo "=== ${name}: $*"
  local start=$SECONDS
  timeout "$STEP_TIMEOUT" "$@" >"$OUT_DIR/${name}.log" 2>&1
  local rc=$?
  echo "=== ${name}: exit ${rc} after $((SECONDS - start)) s"
  grep -aE "local cluster|epoch|test accuracy|downpour replica|wrote|cores=|^(lc|mlp|digits|speech) " \
    "$OUT_DIR/${name}.log" | tail -n 20
  [ "$rc" -eq 0 ] || failed=1
}

nvidia-smi -L || { echo "nvidia-smi not found: not a GPU host"; exit 2; }
"$PYTHON" -c "import tensorflow as tf; print('TensorFlow', tf.__version__, 'GPUs:', tf.config.list_physical_devices('GPU'))"

nvidia-smi --query-compute-apps=timestamp,pid,process_name,gpu_uuid,used_memory \
  --format=csv -l 2 >"$OUT_DIR/nvidia_smi_apps.csv" 2>&1 &
sampler=$!
trap 'kill "$sampler" 2>/dev/null' EXIT

step main "$PYTHON" launch/train.py --model=digits --optimizer=adagrad \
  --num_workers=2 --num_ps=2
step downpour "$PYTHON" launch/train.py --model=speech --downpour \
  --n_fetch=4 --n_push=4 --num_workers=2 --num_ps=2
step model_parallel_job "$PYTHON" launch/train.py --model=speech \
  --devices_per_replica=2 --num_workers=2 --num_ps=2
step model_parallel_bench "$PYTHON" benchmarks/model_parallel_bench.py \
  --out_dir="$OUT_DIR"
step downpour_bench "$PYTHON" benchmarks/downpour_bench.py --quick \
  --out_dir="$OUT_DIR"

echo "=== processes seen on GPUs (pid, GPU):"
awk -F', ' 'NR > 1 && $2 ~ /^[0-9]+$/ {print $2, $4}' "$OUT_DIR/nvidia_smi_apps.csv" | sort -u
exit "$failed"
