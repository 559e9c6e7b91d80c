#!/usr/bin/env bash
# One-shot GPU check of issue 13: async_vs_sync (long-tail regime) with the engine server and the
# trainer sharing one GPU (sync: time-shared; async: share_accelerators), real processes.
# Carry: .whl (wheels the device image lacks: openai and its dependencies, tensorboardX) and
# .cache/bench_longtail_model (the warm-started model, so both runs start from the same weights).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TF_CPP_MIN_LOG_LEVEL=1
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi -L; python3 -V; nproc; cat /proc/loadavg
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site
python3 -c "import jax, flax, optax, orbax.checkpoint, chex; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'chex', chex.__version__, jax.devices())"
el bench
timeout $(( ${BUDGET:-530} - ($(date +%s) - T0) )) python3 -m experiments.benchmarks.async_vs_sync --regimes=longtail \
  --platform=gpu --async_ratios=${RATIOS:-2} --repeats=${REPEATS:-1} --steps=${STEPS:-50} --warmup_steps=10 \
  --out=${AVS:-/tmp/avs} 2>&1 | tee $OUT/bench.log
el done; cat /proc/loadavg
cp ${AVS:-/tmp/avs}/results.json $OUT/ 2>/dev/null; true
for d in ${AVS:-/tmp/avs}/*/; do n=$(basename $d); cp $d/metrics.jsonl $OUT/$n.jsonl 2>/dev/null; done; ls $OUT
