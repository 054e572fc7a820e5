#!/usr/bin/env bash
# Create .venv and install bigtrain into it: torch first (the CPU build where there is no GPU),
# then the package with its test, ray, eval, docs and vision extras. Safe to re-run; a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: GPU found, installing torch==$TORCH_VERSION (CUDA build)"
    "${PIP[@]}" "torch==$TORCH_VERSION"
  else
    echo "setup: no GPU, installing torch==$TORCH_VERSION (CPU build)"
    # Where pip is set up with a local CPU wheel (as on our dev/CI machines) this takes it;
    # elsewhere set TORCH_INDEX_URL to PyTorch's CPU wheel index to avoid the CUDA download.
    "${PIP[@]}" "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  fi
fi
echo "setup: installing bigtrain and its dependencies"
"${PIP[@]}" -e ".[test,ray,eval,docs,vision]"  # the suite runs the Ray verbs, lm-eval (test_ray.py, test_eval*.py) and builds the docs site
# A C++ compiler: DeepSpeed's CPU ops below and torch.compile's CPU backend (inductor, `train.compile=true`
# on a CPU) compile C++ at run time. Installed where apt-get can (as root), else one line saying what to do.
if ! command -v g++ >/dev/null 2>&1 && ! command -v c++ >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: no C++ compiler found, installing g++ (apt-get)"
    apt-get update -qq && apt-get install -y -qq g++ >/dev/null
  else
    echo "setup: no C++ compiler (g++) found: install one (e.g. apt-get install g++) for DeepSpeed's CPU ops" \
         "and torch.compile on CPU; training with train.compile=false and torch's Adam works without it" >&2
  fi
fi
# DeepSpeed JIT-builds its CPU ops at first use. The shared-memory all-reduce is used by every
# multi-rank CPU job (~1 min to build on 2 cores): build it once here, into the folder the ranks load
# from (this environment's own under ~/.cache/torch_extensions, or TORCH_EXTENSIONS_DIR when set:
# bigtrain/distributed/op_builds.py), instead of inside the first run. CPU Adam (optimizer offload
# only, ~3 min of CPU) is built too when BIGTRAIN_PREBUILD_CPU_ADAM=1.
if [ "${BIGTRAIN_PREBUILD_CPU_ADAM:-}" = 1 ]; then
  echo "setup: building DeepSpeed's shared-memory all-reduce op and CPU Adam (once; later runs only load them)"
else
  echo "setup: building DeepSpeed's shared-memory all-reduce op (once; later runs only load it)"
fi
OPS_LOG=.venv/deepspeed_ops_build.log
if ! .venv/bin/python - >"$OPS_LOG" 2>&1 <<'PY'
from bigtrain.distributed.op_builds import use_environment_ops_dir

print(f"ops folder: {use_environment_ops_dir()}")  # before DeepSpeed is imported: where the ranks will look
from deepspeed.accelerator import get_accelerator

accelerator = get_accelerator()
if accelerator.device_name() == "cpu":  # GPU hosts build their CUDA ops at first use, as DeepSpeed does
    import os
    names = ["ShareMemCommBuilder"] + (["CPUAdamBuilder"] if os.environ.get("BIGTRAIN_PREBUILD_CPU_ADAM") == "1" else [])
    for name in names:
        builder = accelerator.create_op_builder(name)
        if builder is not None and builder.is_compatible(verbose=False):
            builder.load(verbose=False)
            print(f"built {builder.absolute_name()}")
PY
then
  echo "setup: building DeepSpeed's CPU ops failed (see $OPS_LOG); the first run will build them" >&2
fi
# bigtrain is installed editable, so pip compiled none of its modules; where PYTHONDONTWRITEBYTECODE
# is set (as on many CI images) every rank would compile them again at every start.
.venv/bin/python -m compileall -q bigtrain tests >/dev/null || true
echo "setup: done: $(.venv/bin/bigtrain --version)"
