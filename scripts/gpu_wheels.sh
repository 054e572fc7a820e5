#!/usr/bin/env bash
# The wheels scripts/gpu_session.sh carries to a GPU machine whose image lacks them (Python 3.12, no network
# there): the versions of this checkout's .venv, into .whl/ (ignored by git; pass `carry: [".whl"]`).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >>.git/info/exclude
mkdir -p .whl
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
# deepspeed ships an sdist only: the wheel pip built for .venv (pure Python, ops built at first use)
.venv/bin/python -m pip wheel --no-deps --no-build-isolation -q -w .whl "deepspeed==$(version deepspeed)"
for pkg in hjson pydantic pydantic_core annotated-types typing-inspection datasets dill multiprocess transformers \
           peft tokenizers huggingface_hub httpx2 httpcore2 truststore; do
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl -q "$pkg==$(version "$pkg")"
done
du -sh .whl
