"""Resume planning: which checkpoint a resumed job loads, whether its model is the one asked for, and how
DeepSpeed loads it (as saved, or converted to a universal checkpoint at another shape: `universal`).

A checkpoint's marker records how its model was built (`ModelBuild`: family, size, overrides). A job
that asks for another model would either fail deep inside DeepSpeed's load with a `size mismatch`
traceback or, where the shapes happen to agree (another head count), load the weights into a different
model and train on silently. Both are refused here with one line naming what differs.
"""
from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bigtrain.checkpoint import store as checkpoint
from bigtrain.checkpoint.safe_load import refuse_unsafe_files
from bigtrain.checkpoint.state import CheckpointState, ModelBuild
from bigtrain.checkpoint.universal import SUFFIX, convert_collectively
from bigtrain.distributed.world import World
from bigtrain.config.topology import Topology

log = logging.getLogger("bigtrain")

# The data's sequence length: it sizes batches and FLOPs, not the weights (positions are the model's
# n_positions / max_position_embeddings, which are compared).
NOT_THE_MODEL = {"seq_len"}
_ABSENT = object()


def check_same_model(tag_dir: Path, state: CheckpointState, wanted: ModelBuild) -> None:
    """ValueError (one line) when `wanted` is not the model the checkpoint in `tag_dir` trained."""
    if state.model_build is None:  # a marker from before bigtrain recorded the build: nothing to compare
        return
    differences = model_differences(state.model_build, wanted)
    if differences:
        shown = "; ".join(differences[:6]) + (f"; and {len(differences) - 6} more" if len(differences) > 6 else "")
        raise ValueError(f"--resume: {tag_dir} trained another model ({shown}): resume with the "
                         "model settings it was trained with, or start a new run with another --out (or "
                         "--overwrite to delete this run's checkpoints)")


def check_same_objective(tag_dir: Path, run_config: dict | None, kind: str) -> None:
    """ValueError (one line) when the job trains another objective than the checkpoint's: its optimizer state and
    step count belong to that loss, and the curve would change meaning without a word."""
    saved = ((run_config or {}).get("objective") or {}).get("kind")
    if saved is not None and saved != kind:
        raise ValueError(f"--resume: {tag_dir} trained objective.kind={saved}, this job asks for {kind}: resume "
                         f"with --set objective.kind={saved}, or start a {kind} run from its weights (bigtrain export, "
                         "then model.pretrained=EXPORT) with another --out")


def model_differences(saved: ModelBuild, wanted: ModelBuild) -> list[str]:
    """`what saved -> wanted` for each setting that differs: family, size, then every setting the two builds
    resolve to (the named size's settings under the overrides, compared as JSON, as the marker holds them)."""
    found = [f"model.{name} {a} -> {b}" for name, a, b in
             (("family", saved.family, wanted.family), ("size", saved.size, wanted.size)) if a != b]
    if saved.family != wanted.family:  # another family's settings are another vocabulary: the family says it
        return found
    before_all = _settings(saved)
    now = _settings(wanted)
    for key in sorted((set(before_all) | set(now)) - NOT_THE_MODEL):
        before, after = before_all.get(key, _ABSENT), now.get(key, _ABSENT)
        if before != after and not (key == "pretrained" and _same_directory_config(before, after)):
            found.append(f"{key} {_shown(before)} -> {_shown(after)}")
    return found


def _settings(build: ModelBuild) -> dict:
    from bigtrain.models.registry import size_settings
    try:
        named = size_settings(build.family, build.size)
    except (KeyError, ValueError):  # a family this bigtrain does not know: its overrides are all there is
        named = {}
    return json.loads(json.dumps({**named, **build.overrides}, default=str))


def _same_directory_config(before: Any, after: Any) -> bool:
    """Two pretrained directories with the same config.json build the same model (a copied directory); one that
    is gone since the save (moved) cannot be compared, and the weights come from the checkpoint anyway."""
    if not (isinstance(before, str) and isinstance(after, str)):
        return False
    saved, now = Path(before) / "config.json", Path(after) / "config.json"
    if not saved.is_file():
        return True
    return now.is_file() and json.loads(saved.read_text()) == json.loads(now.read_text())


def _shown(value: Any) -> str:
    return "(not set)" if value is _ABSENT else json.dumps(value)


@dataclass(frozen=True)
class Shape:
    """What a ZeRO checkpoint's layout depends on.

    The optimizer's offload device counts too: offloading swaps the optimizer class (torch's or
    the fused Adam for DeepSpeedCPUAdam), whose saved param groups do not load into the other
    one (KeyError 'bias_correction'), while the universal checkpoint loads into either.
    """

    world_size: int
    zero_stage: int
    pipeline_stages: int = 1
    optimizer_offload: str = "none"
    tensor_parallel: int = 1  # AutoTP shards each weight over this many ranks (files mp_rank_00, mp_rank_01, ...)
    expert_parallel: int = 1  # AutoEP keeps 1/N of the experts per rank, under its own names (mlp.experts.w1, ...)

    @classmethod
    def of_checkpoint(cls, state: CheckpointState) -> "Shape":
        """The shape recorded in a checkpoint's bigtrain.json marker."""
        return cls.of_job(state.world_size, state.ds_config, state.pipeline_stages)

    @classmethod
    def of_job(cls, world_size: int, ds_config: dict, pipeline_stages: int) -> "Shape":
        zero = ds_config.get("zero_optimization") or {}
        offload = (zero.get("offload_optimizer") or {}).get("device") or "none"
        topology = Topology.of(ds_config, world_size)
        return cls(world_size, int(zero.get("stage", 0)), pipeline_stages, str(offload), topology.tensor,
                   topology.expert)

    def __str__(self) -> str:
        text = f"world size {self.world_size} / ZeRO-{self.zero_stage}"
        text += f" / {self.pipeline_stages} pipeline stages" if self.pipeline_stages > 1 else ""
        text += f" / tensor parallel {self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        text += f" / expert parallel {self.expert_parallel}" if self.expert_parallel > 1 else ""
        return text + (f" / optimizer offload {self.optimizer_offload}" if self.optimizer_offload != "none" else "")


@dataclass(frozen=True)
class ResumePlan:
    """Which checkpoint to resume from and how DeepSpeed loads it."""

    ckpt_dir: Path
    tag: str  # the checkpoint found: step_NNNNNN
    state: CheckpointState  # its bigtrain.json marker
    saved: Shape
    current: Shape
    universal: bool  # load CKPT/<tag>_universal with checkpoint.load_universal

    @property
    def load_tag(self) -> str:
        return self.tag + SUFFIX if self.universal else self.tag


def plan_resume(ckpt_dir: Path, found: tuple[str, CheckpointState], current: Shape, world: World,
                trust: bool = False) -> ResumePlan:
    """How to load the checkpoint `found` (`store.find_resumable`) and, if its shape differs, convert it (collective).

    Every rank calls this before the engine exists. Rank 0 converts while the others wait;
    unsupported shape changes, and files that would need types outside the allow-list (unless
    `trust`, see `safe_load`), raise the same ValueError on every rank before that. (A resumed job keeps the
    checkpoint's global batch unless batch.global_batch is given: `bigtrain.ds.batch`, which says so.)
    """
    tag, state = found
    if not trust:
        refuse_unsafe_files(ckpt_dir / tag)  # before the engine and data are built: fail fast
    saved = Shape.of_checkpoint(state)
    universal = needs_universal(saved, current, ckpt_dir / tag)
    if universal:
        path, reused = convert_collectively(ckpt_dir, tag, world, trust)
        if world.is_main:
            done = "reusing the universal checkpoint at" if reused else "converted to a universal checkpoint at"
            log.info("checkpoint saved at %s, this job is %s: %s %s", saved, current, done, path)
    return ResumePlan(ckpt_dir, tag, state, saved, current, universal)


def needs_universal(saved: Shape, current: Shape, where: Path) -> bool:
    """False when DeepSpeed loads the checkpoint as is; ValueError when no conversion can help."""
    if saved == current:
        return False
    if saved.pipeline_stages > 1 or current.pipeline_stages > 1:
        raise ValueError(f"checkpoint {where} was saved at {saved}, this job is {current}: bigtrain resumes "
                         "pipeline checkpoints only at the shape they were saved at (pipeline layers are not "
                         "named like the plain module's parameters, so the universal conversion has no mapping); "
                         f"resume with world size {saved.world_size}, pipeline.stages={saved.pipeline_stages} "
                         f"and zero.stage={saved.zero_stage}")
    if saved.expert_parallel != current.expert_parallel and 1 in (saved.expert_parallel, current.expert_parallel):
        raise ValueError(f"checkpoint {where} was saved at {saved}, this job is {current}: DeepSpeed's AutoEP keeps "
                         "the experts under its own names (mlp.experts.w1/w2/w3, mlp.router), which a model without "
                         "expert parallelism does not have, and the other way round; resume with parallel.expert="
                         f"{saved.expert_parallel}, or export the run (bigtrain export writes the experts under "
                         "transformers' names) and train on from the export")
    if saved.zero_stage == 0 and current.zero_stage == 0 and saved.tensor_parallel == current.tensor_parallel \
            and saved.expert_parallel == current.expert_parallel:
        return False  # the whole optimizer state is in one file: any world size loads it
    if saved.zero_stage == 3 and saved.tensor_parallel > 1 and saved.tensor_parallel != current.tensor_parallel:
        raise ValueError(f"checkpoint {where} was saved at {saved}: DeepSpeed's universal conversion cannot read a "
                         "tensor-parallel ZeRO-3 checkpoint (its shapes are recorded before AutoTP split the weights), "
                         f"so it resumes only with parallel.tensor={saved.tensor_parallel}; bigtrain export still "
                         "writes its whole weights")
    if saved.zero_stage == 0 and saved.tensor_parallel != current.tensor_parallel:
        raise ValueError(f"checkpoint {where} was saved at {saved}: its weights are tensor-parallel shards and "
                         "ZeRO-0 writes no optimizer partitions for DeepSpeed's universal conversion, so it resumes "
                         f"only with parallel.tensor={saved.tensor_parallel}")
    if saved.zero_stage == 0:
        raise ValueError(f"checkpoint {where} was saved with ZeRO-0, which writes no optimizer partitions for "
                         f"DeepSpeed's universal checkpoint conversion, so it cannot resume at ZeRO-"
                         f"{current.zero_stage}; resume with zero.stage=0 (any world size works)")
    if current.zero_stage == 0:
        raise ValueError(f"checkpoint {where} was saved at {saved}; DeepSpeed loads a converted (universal) "
                         "checkpoint only into ZeRO stages 1-3, not ZeRO-0; resume with zero.stage=1 (the "
                         "same memory as ZeRO-0 at one rank)")
    if "nvme" in (saved.optimizer_offload, current.optimizer_offload):
        raise ValueError(f"checkpoint {where} was saved at {saved}, this job is {current}: DeepSpeed neither "
                         "converts nor loads universal checkpoints with the optimizer offloaded to NVMe; resume "
                         "at the saved shape, or from a checkpoint saved with offload.optimizer=none or cpu")
    return True


def restore_rng(plan: ResumePlan, rank: int, seed: int, trust: bool = False) -> tuple[str, dict | None]:
    """This rank's RNG after a resume (the one place it is set): how it was set (for the log), and the rank's own
    state saved beside it (`store.save`'s rank_state: an objective's random stream), None where there is none.

    At the saved world size each rank takes back its own stream. At another one, per-rank
    streams have no 1:1 mapping (dropout masks of the uninterrupted run fall on other
    samples anyway), so every rank is re-seeded from (seed, step, rank): reproducible, and
    different on every rank; no rank state is given back.
    """
    rng_file = plan.ckpt_dir / plan.tag / f"rng_rank{rank}.pt"
    if plan.saved.world_size == plan.current.world_size and rng_file.is_file():
        saved = checkpoint.load_rng_file(rng_file, trust)
        checkpoint.set_rng_state(saved)
        return "restored", saved.get("objective")
    derived = int(np.random.SeedSequence([seed, plan.state.step, rank]).generate_state(1)[0])
    random.seed(derived)
    np.random.seed(derived)
    torch.manual_seed(derived)
    return f"re-seeded from (seed {seed}, step {plan.state.step}, rank)", None
