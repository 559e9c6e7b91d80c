#!/usr/bin/env bash
# One-shot H200 check of issue 13: async_vs_sync (long-tail regime) with the engine server and the
# trainer sharing one GPU (sync: time-shared; async: share_accelerators), real processes.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TF_CPP_MIN_LOG_LEVEL=1
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi -L; python3 -V; nproc; cat /proc/loadavg
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site
python3 -c "import jax, flax, optax, orbax.checkpoint, chex; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'chex', chex.__version__, jax.devices())"
GPU="--set=resources.platform=gpu --max_running_requests=32"
smoke() {
  timeout 200 python3 -m experiments.train --config=experiments/configs/bench_rlvr_longtail.py \
    --workdir=/tmp/smoke$1 --steps=4 --eval_every=0 --progress=false --plot=false \
    --mode=async --async_ratio=2 --set=resources.share_accelerators=true $GPU
}
el bench
timeout $(( ${BUDGET:-530} - ($(date +%s) - T0) )) python3 -m experiments.benchmarks.async_vs_sync --regimes=longtail \
  --async_ratios=${RATIOS:-2,4} --async_splits=1+1 --steps=${STEPS:-60} --warmup_steps=10 \
  --out=${AVS:-/tmp/avs} --train_flags="--set=resources.platform=gpu,--max_running_requests=32,--set=resources.share_accelerators=true" 2>&1 | tee $OUT/bench.log
el done; cat /proc/loadavg
cp ${AVS:-/tmp/avs}/results.json $OUT/ 2>/dev/null; true
for d in ${AVS:-/tmp/avs}/*/; do n=$(basename $d); cp $d/metrics.jsonl $OUT/$n.jsonl 2>/dev/null; done; ls $OUT
