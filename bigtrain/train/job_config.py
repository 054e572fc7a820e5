"""The job's DeepSpeed dict, resolved the same way each time it is needed (the first engine, the micro-batch
probe's throw-away engine, a universal-checkpoint resume), each note logged once."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

from bigtrain.checkpoint.state import CheckpointState
from bigtrain.config.run_config import RunConfig
from bigtrain.distributed.host import return_freed_memory
from bigtrain.distributed.world import World
from bigtrain.ds.resolve import Resolved, resolve

log = logging.getLogger("bigtrain")


@dataclass
class JobConfig:
    """Everything `resolve` needs for this job, so that each resolution of its DeepSpeed dict is the same call."""

    run: RunConfig
    ds_config_path: str | None
    world: World
    sources: dict[str, str] | None
    found: tuple[str, CheckpointState] | None  # (tag, state) of the checkpoint to resume from
    auto_micro: bool = False  # batch.micro_batch=auto: the probe decides it
    kept: tuple[str, ...] = ()  # the fields taken from the checkpoint resumed (`provenance.keep_recorded`)
    first: Resolved | None = None
    said: set[str] = field(default_factory=set)  # notes logged already

    def resolve(self, micro_batch: int | None = None, load_universal: bool = False) -> Resolved:
        """The DeepSpeed dict the engine gets, its new notes logged. `micro_batch`: the probed one, the global
        batch kept (`batch.micro_batch=auto`); `load_universal`: the resume loads a universal checkpoint."""
        batch = None
        if micro_batch is not None:
            assert self.first is not None, "the micro-batch is probed after a first resolution"
            batch = {"global_batch": self.first.ds_config["train_batch_size"], "micro_batch": micro_batch}
        resolved = self._resolve(self.run, batch, load_universal, str(Path(self.run.train.out_dir)))
        if self.first is None:
            self.first = resolved
            if offloads_to_host(resolved.ds_config) and return_freed_memory() and self.world.is_main:
                log.info("offload: malloc returns freed memory to the system (more fits; BIGTRAIN_MALLOC_TUNING=1 "
                         "keeps it)")
        for note in resolved.notes:
            if note not in self.said and self.world.is_main:
                log.info("%s", note)
            self.said.add(note)
        return resolved

    def probe_config(self) -> dict:
        """A throw-away engine's dict for the micro-batch probe: one sample per rank, eager, no monitors."""
        assert self.first is not None
        config = self.first.ds_config
        dp = config["train_batch_size"] // (config["train_micro_batch_size_per_gpu"]
                                            * config["gradient_accumulation_steps"])
        eager = replace(self.run, train=replace(self.run.train, compile=False))
        return self._resolve(eager, {"global_batch": dp, "micro_batch": 1, "grad_accum": 1}, False, None).ds_config

    def _resolve(self, run: RunConfig, batch: dict | None, load_universal: bool, out_dir: str | None) -> Resolved:
        # a fixed batch was decided by a first resolution that kept the checkpoint's global batch already
        resume_batch = self.found[1].ds_config.get("train_batch_size") if self.found and not batch else None
        return resolve(run, self.ds_config_path, self.world.size, sources=self.sources, out_dir=out_dir,
                       resume_batch=resume_batch, batch=batch, load_universal=load_universal)


def offloads_to_host(ds_config: dict) -> bool:
    zero = ds_config.get("zero_optimization", {})
    return any(zero.get(key, {}).get("device") in ("cpu", "nvme") for key in ("offload_optimizer", "offload_param"))
