"""objective.reference=precomputed: the reference model's log-probability of every answer of the prepared
preference data, computed once before training by a frozen copy (the engine objective.reference=copy steps with,
partitioned like the policy at ZeRO-3), which is then freed: the policy trains beside no second model.

The table is a file beside the prepared data, `<prepared>/reference_logps/<key>.npy`, one float32 per example (the
summed log-probability of its answer's tokens within data.seq_len), with `<key>.json` saying what it was computed
from. The key covers what decides the numbers: the model (its build, its weight files, the seed when it starts
from random weights), the precision, data.seq_len and the prepared corpus (its manifest). A later run on the same
model and data, and every resume, read it instead of computing it again; a missing or damaged file is computed
again. (TRL's precompute_ref_log_probs keeps its values in memory, computed again by every run.)
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator

from bigtrain.atomic import replacing, temporaries, write_atomic
from bigtrain.checkpoint.state import ModelBuild
from bigtrain.data.dataset import ConcatRows, DataBundle
from bigtrain.data.pairs import AnswerRows, PairRows
from bigtrain.distributed.world import World, all_ranks_agree
from bigtrain.ds.release import release_engine
from bigtrain.models.spec import ModelSpec
from bigtrain.train.engine import float_dtype_of
from bigtrain.train.policy import to_device
from bigtrain.train.reference import FrozenCopy, build_reference

log = logging.getLogger("bigtrain")

VERSION = "answer log-probabilities v1"  # what one number is: changes with the formula (objectives.preference)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def attach_reference_logps(bundle: DataBundle, spec: ModelSpec, ds_config: dict, seed: int, model_build: ModelBuild,
                           world: World) -> dict:
    """Give every pair of `bundle` its reference log-probabilities (read, or computed and kept); returns what the
    run's summary keeps of it ({"files", "computed_s"}; computed_s None when every table was read)."""
    parts = pair_parts(bundle.train) + pair_parts(bundle.val)
    corpora: dict[str, PairRows] = {}  # one table per prepared corpus
    for part in parts:
        corpora.setdefault(str(part.corpus.root), part)
    tables: dict[str, np.ndarray] = {}
    files: list[str] = []
    copy, started = None, time.perf_counter()
    for root, part in corpora.items():
        ident = table_ident(part, ds_config, seed, model_build)
        path = part.corpus.root / "reference_logps" / f"{key_of(ident)}.npy"
        table = read_table(path, len(part.examples))
        if not all_ranks_agree(table is not None):
            if copy is None:
                copy = build_reference("copy", spec, ds_config, seed)
            rows = 2 * int(ds_config["train_micro_batch_size_per_gpu"])  # the rows of training's reference pass
            table = compute_table(copy, spec, part.examples, rows, world)
            if world.local_rank == 0:
                keep_table(path, table, ident)
            if world.is_main:
                log.info("reference log-probabilities (objective.reference=precomputed): %d answers of %s computed "
                         "in %.1f s by a frozen copy, kept in %s", len(table), root, time.perf_counter() - started,
                         path)
        elif world.is_main:
            log.info("reference log-probabilities (objective.reference=precomputed): read from %s (computed before "
                     "for this model and data)", path)
        tables[root], files = table, files + [str(path)]
    computed_s = None
    if copy is not None:
        computed_s = round(time.perf_counter() - started, 3)
        free(copy)
    for part in parts:
        part.reference = tables[str(part.corpus.root)]
    return {"files": files, "computed_s": computed_s}


def pair_parts(dataset: Any) -> list[PairRows]:
    if isinstance(dataset, ConcatRows):
        return [p for part in dataset.parts for p in pair_parts(part)]
    assert isinstance(dataset, PairRows), f"objective.reference=precomputed on {type(dataset).__name__}, not pairs"
    return [dataset]


def table_ident(part: PairRows, ds_config: dict, seed: int, model_build: ModelBuild) -> dict:
    """What a table's numbers depend on."""
    pretrained = model_build.overrides.get("pretrained")
    weights = weight_files(Path(pretrained)) if pretrained else []
    manifest = json.dumps(part.corpus.manifest, sort_keys=True, default=str)
    return {"version": VERSION, "model": model_build.to_json(), "weights": weights,
            "seed": None if weights else seed,  # random weights: the seed makes them
            "precision": str(float_dtype_of(ds_config)).removeprefix("torch."), "seq_len": part.seq_len,
            "data": hashlib.sha256(manifest.encode()).hexdigest()}


def weight_files(directory: Path) -> list[list]:
    """[name, bytes, modification ns] of a model directory's weight files, with its config.json's digest."""
    if not directory.is_dir():
        return []
    found = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(directory.iterdir())
             if p.suffix in WEIGHT_SUFFIXES and p.is_file()]
    config = directory / "config.json"
    if found and config.is_file():
        found.append(["config.json", hashlib.sha256(config.read_bytes()).hexdigest()])
    return found


def key_of(ident: dict) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:20]


def read_table(path: Path, examples: int) -> np.ndarray | None:
    """The kept table, or None when it is missing or not whole (computed again then)."""
    try:
        table = np.load(path)
    except (OSError, ValueError):
        return None
    if table.shape != (examples,) or table.dtype != np.float32 or not np.isfinite(table).all():
        log.warning("%s is damaged (%s, %s values for %d answers): computing it again", path, table.dtype,
                    table.shape, examples)
        return None
    return table


def keep_table(path: Path, table: np.ndarray, ident: dict) -> None:
    """Written whole or not at all (a temporary file renamed), so that a killed job leaves no half table."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with replacing(path) as f:
            np.save(f, table)
        write_atomic(path.with_suffix(".json"), json.dumps(ident, indent=1, default=str) + "\n")
        for debris in temporaries(path):  # a killed job's half table: never read
            debris.unlink(missing_ok=True)
    except OSError as err:
        log.warning("could not keep the reference log-probabilities beside the prepared data (%s); the next run "
                    "computes them again", err)


@torch.no_grad()
def compute_table(copy: FrozenCopy, spec: ModelSpec, rows: AnswerRows, per_pass: int, world: World) -> np.ndarray:
    """Every example's answer log-probability: rank r computes examples r, r + N, ... in passes of `per_pass` rows,
    every rank the same number of passes (ZeRO-3 gathers each layer's weights with all ranks), then an all-gather."""
    device = get_accelerator().current_device_name()
    examples = len(rows)
    passes = -(-examples // (world.size * per_pass))
    mine = np.arange(world.rank, examples, world.size)
    padded = np.resize(mine if len(mine) else np.zeros(1, np.int64), passes * per_pass)  # repeats fill the last
    values = []
    for p in range(passes):
        inputs, labels = spec.batch_to_inputs(rows.take(padded[p * per_pass:(p + 1) * per_pass].tolist()))
        values.append(copy.logps(None, to_device(inputs, device), labels.to(device)).float())
    local = torch.cat(values)
    gathered = [torch.empty_like(local) for _ in range(world.size)]
    if torch.distributed.is_initialized():
        torch.distributed.all_gather(gathered, local)
    else:
        gathered = [local]
    table = np.full(examples, np.nan, dtype=np.float32)
    for rank, part in enumerate(gathered):
        theirs = np.arange(rank, examples, world.size)
        table[theirs] = part[:len(theirs)].cpu().numpy()
    return table


def free(copy: FrozenCopy) -> None:
    """The copy's weights given back before the policy is built."""
    engine, copy.ds = copy.ds, None
    release_engine(engine)
