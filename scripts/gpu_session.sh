#!/usr/bin/env bash
# One short GPU lease in one call: what the device image lacks (wheels carried in .whl/, made by
# scripts/gpu_wheels.sh; see
# docs/benchmarks.md), then `bigtrain bench --gpu` in its priority order (it stops itself after
# BENCH_MIN minutes), then the fine-tuning journeys (scripts/gpu_journeys.py, JOURNEY_MIN minutes).
# Everything lands in $OUT: versions, the bench's page section and JSON, logs, journeys.json.
#
#   bash scripts/gpu_session.sh BENCH_MIN JOURNEY_MIN [ONLY_REGEX]     (JOURNEY_MIN 0: no journeys)
#   DRY=1 bash scripts/gpu_session.sh 3 3      # the same on this host's CPU: bench --dry-run, tiny journeys
set -u
BENCH_MIN=${1:-4}
JOURNEY_MIN=${2:-3}
ONLY=${3:-}
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "${DRY:-0}" != 1 ] && ls .whl/*.whl >/dev/null 2>&1; then  # DRY: this host has its venv
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
if ! command -v bigtrain >/dev/null; then
  mkdir -p /tmp/site/bin
  printf '#!/bin/sh\nexec python3 -m bigtrain.cli "$@"\n' >/tmp/site/bin/bigtrain
  chmod +x /tmp/site/bin/bigtrain
  export PATH=/tmp/site/bin:$PATH
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, torch, deepspeed, transformers, peft; print(sys.version.split()[0], 'torch', torch.__version__,
'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
} 2>&1 | tee "$OUT/versions.txt"
# A build killed mid-way (an earlier call on this machine) leaves torch's lock file, and every later build
# waits on it forever: nothing else builds now, so remove it.
rm -f "${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}"/*/*/lock
# DeepSpeed JIT-builds FusedAdam at the first job; build it now, beside the peak measurement.
python3 - >/tmp/fused_adam_build.log 2>&1 <<'PY' &
from bigtrain.distributed.device import fix_cuda_arch_list
print(fix_cuda_arch_list())
from deepspeed.ops.op_builder import FusedAdamBuilder
FusedAdamBuilder().load()
print("fused_adam built")
PY
bench=(python3 -m bigtrain.cli bench --gpu --max-minutes "$BENCH_MIN" --workdir /tmp/bench)
[ -n "$ONLY" ] && bench+=(--only "$ONLY")
[ "${DRY:-0}" = 1 ] && bench+=(--dry-run)
timeout "${HARD_S:-100000}" "${bench[@]}" 2>&1 | tee "$OUT/bench.log"
page=docs; [ "${DRY:-0}" = 1 ] && page=/tmp/bench
cp $page/benchmarks.md $page/benchmarks_gpu.json /tmp/bench/results_so_far.json "$OUT/" 2>/dev/null
if [ "$JOURNEY_MIN" != 0 ]; then
  python3 scripts/gpu_journeys.py --out "$OUT" --minutes "$JOURNEY_MIN" $([ "${DRY:-0}" = 1 ] && echo --tiny) 2>&1 | tee "$OUT/journeys.log"
fi
# Every job's logs in one archive (8 files at most come back from $OUT).
tar czf "$OUT/logs.tgz" /tmp/fused_adam_build.log /tmp/bench/*/log.txt /tmp/bench/*/logs /tmp/bench/*/summary.json \
  /tmp/bench/*/result_rank0.json 2>/dev/null
exit 0
