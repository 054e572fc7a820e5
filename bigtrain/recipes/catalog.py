"""The recipes bigtrain ships: run configs (YAML, the run config's own keys) for the jobs people run, each with a
header of comments saying the job, the model, the hardware, the data and the time it was sized for:

    # job: full supervised fine-tuning ...
    # model: meta-llama/Llama-3.1-8B-Instruct ...
    # hardware: 8 x 80 GB GPUs (one node)         "2 nodes of 8 x 80 GB GPUs", "1 x 24 GB GPU"
    # data: ...
    # time: ...

The hardware line is read (GPUs per node, nodes, memory per GPU): `bigtrain recipes` estimates each recipe's
memory per GPU on it with bigtrain's memory model, and tests/unit/test_recipes.py holds every recipe to fit it.
"""
from __future__ import annotations

import difflib
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bigtrain.config.run_config import RunConfig
    from bigtrain.ds.resolve import Resolved
    from bigtrain.estimate.memory_model import MemoryEstimate

HERE = Path(__file__).resolve().parent
HEADER_KEYS = ("job", "model", "hardware", "data", "time")
_HARDWARE = re.compile(r"(?:(\d+) nodes? of )?(\d+) x (\d+(?:\.\d+)?) ?GB GPUs?")


@dataclass(frozen=True)
class Hardware:
    """What a recipe was sized for: GPUs per node, nodes, bytes of memory per GPU (GB as GPUs are sold)."""

    gpus_per_node: int
    nodes: int
    gpu_mem: int

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def __str__(self) -> str:
        gpus = f"{self.gpus_per_node} x {self.gpu_mem / 1e9:g} GB"
        return f"{self.nodes} x {gpus}" if self.nodes > 1 else gpus


@dataclass(frozen=True)
class Recipe:
    name: str  # the file's name without .yaml
    path: Path
    header: dict[str, str]  # job, model, hardware, data, time (HEADER_KEYS), as written

    @property
    def hardware(self) -> Hardware:
        found = _HARDWARE.search(self.header["hardware"])
        assert found, f"{self.path}: the hardware line names no 'N x M GB GPUs': {self.header['hardware']!r}"
        nodes, gpus, mem = found.groups()
        return Hardware(int(gpus), int(nodes or 1), int(float(mem) * 1e9))

    def run_config(self, overrides: list[str] | None = None) -> RunConfig:
        """The recipe as training loads it (`--config RECIPE --set ...`)."""
        from bigtrain.config.load import load_run_config
        return load_run_config(self.path, overrides)

    def deepspeed(self, overrides: list[str] | None = None, world_size: int | None = None) -> Resolved:
        """The DeepSpeed dict it trains with on its hardware (a GPU's), generated and linted as training does."""
        from bigtrain.config.load import field_sources
        from bigtrain.ds.lint import DeviceCaps
        from bigtrain.ds.resolve import resolve
        return resolve(self.run_config(overrides), None, world_size or self.hardware.world_size,
                       DeviceCaps("cuda", fp16=True, bf16=True), sources=field_sources(self.path, overrides or []))

    def memory(self) -> MemoryEstimate:
        """bigtrain's estimate of the recipe's memory per GPU on its hardware (the model's shape only: the shapes
        of the Hub models the recipes name ship with bigtrain, bigtrain/models/shapes/)."""
        return _memory(self.path, self.path.stat().st_mtime_ns, self.hardware)


@functools.lru_cache(maxsize=None)
def _memory(path: Path, mtime_ns: int, hw: Hardware) -> MemoryEstimate:
    """One estimate per file version: building an 8B model's shape on the meta device takes seconds."""
    from bigtrain.config.load import load_run_config
    from bigtrain.estimate.of_run import estimate_run
    return estimate_run(load_run_config(path), hw.world_size, hw.gpus_per_node, gpu_mem=hw.gpu_mem)[0]


def read_header(path: Path) -> dict[str, str]:
    """The `# key: value` lines at the top of a recipe (a line starting `#   ` continues the one above)."""
    header: dict[str, str] = {}
    key = None
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line[1:].strip()
        name, sep, value = text.partition(":")
        if sep and name in HEADER_KEYS and not line.startswith("#  "):
            key, header[name] = name, value.strip()
        elif key is not None and line.startswith("#  "):
            header[key] += " " + text
    missing = [k for k in HEADER_KEYS if k not in header]
    assert not missing, f"{path}: the recipe's header lacks {', '.join(missing)}"
    return header


def recipes() -> list[Recipe]:
    """Every shipped recipe, by name."""
    return [Recipe(p.stem, p, read_header(p)) for p in sorted(HERE.glob("*.yaml"))]


def recipe(name: str) -> Recipe:
    """The recipe `name` (with or without .yaml); ValueError naming the nearest ones."""
    found = {r.name: r for r in recipes()}
    name = name.removesuffix(".yaml")
    if name not in found:
        near = difflib.get_close_matches(name, list(found), n=3, cutoff=0.4)
        raise ValueError(f"no recipe {name!r}" + (f"; nearest: {', '.join(near)}" if near else "")
                         + "; `bigtrain recipes` lists them")
    return found[name]


def summary_row(item: Recipe) -> dict[str, Any]:
    """What `bigtrain recipes` shows of one recipe: its job, model, GPUs and estimated memory per GPU."""
    est = item.memory()
    return {"name": item.name, "job": item.header["job"], "model": item.header["model"], "gpus": str(item.hardware),
            "gib_per_gpu": est.device_peak / 2**30, "setup": est.setup.label}
