"""Where DeepSpeed's JIT-built ops live: one folder per environment, and a line when one is about to be built.

DeepSpeed compiles its ops at first use (the shared-memory all-reduce every CPU job joins its process group with,
CPU Adam for optimizer offload, FusedAdam on GPUs) through torch's `cpp_extension`, into TORCH_EXTENSIONS_DIR or
else one folder per user (~/.cache/torch_extensions/py311_cpu). Two environments on one machine (two clones, two
virtual environments) then build into the same folder, and each build's ninja file names its own environment's
DeepSpeed sources and torch headers: ninja rebuilds the op whenever the other environment built it last (seven
builds of 35-95 s in one afternoon, each before a run's first line). So bigtrain keys the folder by the environment
(its sys.prefix, Python, torch and DeepSpeed versions) unless the user set TORCH_EXTENSIONS_DIR, everywhere ops are
built: scripts/setup.sh's prebuild, `bigtrain train`'s ranks, `deepspeed bigtrain/run.py`, `bigtrain eval` and the
test harness all call `use_environment_ops_dir`.
"""
from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import MutableMapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

VAR = "TORCH_EXTENSIONS_DIR"
# DeepSpeed's optimizer type -> the op its CPU implementation (optimizer offload) is built as
OFFLOAD_OPS = {"adam": "cpu_adam", "adamw": "cpu_adam", "adagrad": "cpu_adagrad", "lion": "cpu_lion"}


def environment_key(prefix: str | None = None) -> str:
    """What one environment's builds are kept under: Python, torch and DeepSpeed versions (readable) and a hash of
    the environment's sys.prefix (two venvs of the same versions still build apart: their sources differ). The
    prefix as the interpreter sees it, symbolic links unresolved: a ninja file names DeepSpeed's sources by that
    path, so one environment reached by two paths (a linked .venv) would otherwise rebuild at every alternation."""
    prefix = os.path.abspath(sys.prefix if prefix is None else prefix)
    found = []
    for dist in ("torch", "deepspeed"):
        try:
            found.append(f"{dist}{version(dist)}")
        except PackageNotFoundError:
            found.append(f"{dist}-none")
    digest = hashlib.sha256(prefix.encode()).hexdigest()[:10]
    return f"py{sys.version_info.major}{sys.version_info.minor}-{'-'.join(found)}-{digest}"


def environment_ops_dir(prefix: str | None = None) -> Path:
    """This environment's folder under torch's per-user extensions root (~/.cache/torch_extensions)."""
    return Path(torch_build_root()) / environment_key(prefix)


def torch_build_root() -> str:
    """torch's `cpp_extension.get_default_build_root()`, worked out as torch does (its `_appdirs.user_cache_dir`)
    without importing torch where it is not imported yet: `bigtrain train` sets the ranks' folder before it starts
    them, and importing torch there cost about 2.5 CPU seconds before a one-rank job's rank could start."""
    if "torch" in sys.modules or sys.platform == "win32":
        from torch.utils.cpp_extension import get_default_build_root
        return get_default_build_root()
    cache = os.path.expanduser("~/Library/Caches") if sys.platform == "darwin" else \
        os.getenv("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    return os.path.realpath(os.path.join(cache, "torch_extensions"))


def use_environment_ops_dir(env: MutableMapping[str, str] | None = None) -> Path:
    """The folder DeepSpeed's ops build into: the user's TORCH_EXTENSIONS_DIR, else this environment's, set in `env`
    (default os.environ, so this process and every process it starts build there)."""
    env = os.environ if env is None else env
    if not env.get(VAR):
        env[VAR] = str(environment_ops_dir())
    return Path(env[VAR])


def build_note(op: str, root: Path | None = None) -> str | None:
    """A line when DeepSpeed's `op` is about to be built in the ops folder, saying why; None when it will be
    loaded. As torch's cpp_extension decides: no built library there yet, or one built from another DeepSpeed's
    sources (its ninja file names them: another environment, or another DeepSpeed version), which ninja rebuilds."""
    root = Path(os.environ.get(VAR) or environment_ops_dir()) if root is None else Path(root)
    folder = root / op
    built = (folder / f"{op}.so").is_file()
    ninja = folder / "build.ninja"
    ours = _deepspeed_dir()
    theirs = _sources_in(ninja) if built and ninja.is_file() else None
    if built and (theirs is None or ours is None or theirs == ours):
        return None
    if not built:
        return (f"building DeepSpeed's {op} op for this environment (none in {root} yet): once, 1-3 minutes on a "
                "few cores; later runs load it")
    return (f"building DeepSpeed's {op} op again: {folder} holds another environment's build (of {theirs}), which "
            f"ninja replaces (1-3 minutes); give each environment its own {VAR}, or unset it for bigtrain's folder "
            "per environment")


def optimizer_op(ds_config: dict) -> str | None:
    """The op DeepSpeed builds for the optimizer of this config, as its engine picks one: the CPU kernel of an
    offloaded optimizer (cpu_adam, ...), else FusedAdam for Adam(W) unless `torch_adam`; None for the others."""
    zero = ds_config.get("zero_optimization") or {}
    optimizer = ds_config.get("optimizer") or {}
    kind = str(optimizer.get("type", "")).lower()
    if (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme"):
        return OFFLOAD_OPS.get(kind)
    if kind in ("adam", "adamw") and not (optimizer.get("params") or {}).get("torch_adam"):
        return "fused_adam"
    return None


def build_lines(ops: list[str | None]) -> list[str]:
    """A line for each of DeepSpeed's `ops` about to be built (those installed with DeepSpeed load as they are)."""
    from deepspeed.git_version_info import installed_ops
    return [note for op in ops if op and not installed_ops.get(op) and (note := build_note(op))]


def comm_op() -> str | None:
    """The op DeepSpeed builds as it joins the process group: the shared-memory all-reduce of its CPU accelerator
    (None where the accelerator has none, or this machine cannot run it)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    return builder.NAME if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME) else None


def _deepspeed_dir() -> str | None:
    import importlib.util
    spec = importlib.util.find_spec("deepspeed")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return os.path.abspath(locations[0]) if locations else None


def _sources_in(ninja: Path) -> str | None:
    """The DeepSpeed package whose sources a torch ninja file compiles (`.../deepspeed/ops/csrc/...`)."""
    marker = f"{os.sep}deepspeed{os.sep}ops{os.sep}csrc{os.sep}"
    for word in ninja.read_text(errors="replace").split():
        if marker in word:
            head = word.split(marker)[0].removeprefix("-I")
            return os.path.abspath(head + f"{os.sep}deepspeed")  # as ninja compares it: links unresolved
    return None
