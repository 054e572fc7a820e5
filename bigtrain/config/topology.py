"""The split of a job's ranks, one object: pipeline x tensor x sequence x expert x data (torchtitan's ParallelDims).

The run config's rules, the DeepSpeed-JSON lint, the estimator, checkpoints and the engine all read a `Topology`;
each names the sizes in its own vocabulary (`RUN_AXES` for run-config fields, `DS_AXES` for DeepSpeed JSON keys),
so a rule and its wording exist once. Pure: no torch, no DeepSpeed, nothing else of bigtrain (the run config
imports it).

Layout, as DeepSpeed builds its groups: the world splits into `pipeline` stages; a stage's ranks into data-parallel
replicas of `tensor x sequence` consecutive ranks (a tensor group sees one batch, a sequence group splits each
sample). Experts are spread over a stage's ranks (DeepSpeed AutoEP's "folding": an expert group is `expert` ranks,
and each expert is replicated over stage / expert ranks), so `expert` divides the stage and not the data size.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Axes:
    """How a caller names the sizes in its messages: run-config fields, or a DeepSpeed JSON's keys."""

    pipeline: str
    tensor: str
    sequence: str
    expert: str


RUN_AXES = Axes("pipeline.stages", "parallel.tensor", "parallel.sequence", "parallel.expert")
DS_AXES = Axes("pipeline.stages", "tensor_parallel.autotp_size", "sequence_parallel_size",
               "expert_parallel.autoep_size")


@dataclass(frozen=True)
class Topology:
    """`world` ranks as pipeline x data x sequence x tensor; `expert` ranks share one set of experts."""

    world: int
    pipeline: int = 1
    tensor: int = 1
    sequence: int = 1
    expert: int = 1

    # -- the sizes every reader asks for ------------------------------------------------------------

    @property
    def stage(self) -> int:
        """Ranks of one pipeline stage (the whole world without a pipeline)."""
        return self.world // self.pipeline

    @property
    def model_split(self) -> int:
        """Ranks that share one batch (a tensor or sequence group)."""
        return self.tensor * self.sequence

    @property
    def replica(self) -> int:
        """Ranks that hold one whole model: pipeline x tensor x sequence."""
        return self.pipeline * self.model_split

    @property
    def data(self) -> int:
        """Data-parallel replicas: ranks reading different samples (DeepSpeed's batch triple counts these)."""
        return self.world // self.replica

    @property
    def zero_ranks(self) -> int:
        """Ranks ZeRO partitions a stage's states over: data x sequence (a tensor group's ranks hold other
        shards already)."""
        return self.stage // self.tensor

    @property
    def expert_data(self) -> int:
        """Replicas of each expert: a stage's ranks over the expert group (DeepSpeed's expert-data-parallel size)."""
        return self.stage // self.expert

    @property
    def axes(self) -> dict[str, int]:
        return {"pipeline": self.pipeline, "tensor": self.tensor, "sequence": self.sequence, "expert": self.expert}

    # -- construction -------------------------------------------------------------------------------

    @classmethod
    def of(cls, ds_config: dict, world: int) -> "Topology":
        """The split a resolved DeepSpeed dict asks for."""
        tensor, sequence, expert = split_sizes(ds_config)
        pipeline = ds_config.get("pipeline") if isinstance(ds_config.get("pipeline"), dict) else {}
        stages = pipeline.get("stages", 1)
        stages = stages if isinstance(stages, int) and not isinstance(stages, bool) and stages >= 1 else 1
        return cls(world, stages, tensor, sequence, expert)

    @classmethod
    def of_run(cls, parallel: object, pipeline_stages: int, world: int) -> "Topology":
        """The split a run config's `parallel` section and pipeline stages ask for at `world` ranks."""
        sizes = (parallel.tensor, parallel.sequence, parallel.expert)  # type: ignore[attr-defined]
        return cls(world, pipeline_stages, *sizes)

    # -- rules ---------------------------------------------------------------------------------------

    def combination_problems(self, keys: Axes = RUN_AXES) -> list[str]:
        """Sizes DeepSpeed 0.19.8 (or bigtrain around it) cannot run together, whatever the world: one line each."""
        problems = []
        for name, size in ((keys.tensor, self.tensor), (keys.sequence, self.sequence), (keys.expert, self.expert)):
            if size > 1 and self.pipeline > 1:
                problems.append(f"{name}={size} with {keys.pipeline}={self.pipeline}: DeepSpeed's pipeline engine "
                                f"takes its own process groups and runs none of AutoTP, Ulysses and AutoEP; set "
                                f"{name}=1 or {keys.pipeline}=1")
        for name, size in ((keys.tensor, self.tensor), (keys.sequence, self.sequence)):
            if size > 1 and self.expert > 1:
                problems.append(f"{keys.expert}={self.expert} with {name}={size}: bigtrain trains experts over "
                                f"data-parallel ranks only (DeepSpeed's AutoEP folding with AutoTP/Ulysses is not "
                                f"proven here); set {name}=1, or {keys.expert}=1 (ZeRO partitions the experts)")
        return problems

    def divisibility_problem(self, keys: Axes = RUN_AXES) -> str | None:
        """The world must split into whole replicas, and a stage into whole expert groups; None when it does."""
        if self.world < 1 or min(self.axes.values()) < 1:
            return f"world size {self.world} and every split size ({self._named(keys, every=True)}) must be >= 1"
        if self.world % self.replica:
            if self.model_split == 1:
                return (f"world size {self.world} is not divisible by {keys.pipeline}={self.pipeline}: launch a "
                        f"multiple of {self.pipeline} ranks (e.g. --num_gpus "
                        f"{self.pipeline * max(1, self.world // self.pipeline)}) or choose {keys.pipeline} dividing "
                        f"{self.world}")
            return (f"world size {self.world} is not divisible by {self._named(keys)} = {self.replica} ranks per "
                    f"model replica: launch a multiple of {self.replica} ranks or choose sizes whose product "
                    f"divides {self.world}")
        if self.stage % self.expert:
            return (f"{keys.expert}={self.expert} does not divide the {self.stage} ranks"
                    f"{' of a pipeline stage' if self.pipeline > 1 else ''}: DeepSpeed's AutoEP spreads each set of "
                    f"experts over {self.expert} of them; launch a multiple of {self.expert} ranks or choose "
                    f"{keys.expert} dividing {self.stage}")
        return None

    def problems(self, keys: Axes = RUN_AXES) -> list[str]:
        """Every rule this split breaks, one line each."""
        problems = self.combination_problems(keys)
        problem = self.divisibility_problem(keys)
        return problems + ([problem] if problem else [])

    def check(self, keys: Axes = RUN_AXES) -> "Topology":
        """Itself; ValueError with every problem (one per line) naming the sizes and the fix."""
        problems = self.problems(keys)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def label(self) -> str:
        """Short form for tables and logs: dp4, tp2+dp2, sp2, ep2+dp2, pp2+dp1."""
        parts = [f"{short}{size}" for short, size in (("pp", self.pipeline), ("tp", self.tensor),
                                                      ("sp", self.sequence), ("ep", self.expert)) if size > 1]
        return "+".join(parts + [f"dp{self.data}"]) if parts else f"dp{self.data}"

    def _named(self, keys: Axes, every: bool = False) -> str:
        sizes = ((keys.pipeline, self.pipeline), (keys.tensor, self.tensor), (keys.sequence, self.sequence),
                 (keys.expert, self.expert))
        return (", " if every else " x ").join(f"{name}={size}" for name, size in sizes
                                               if every or (size > 1 and name != keys.expert))


def check_topology(world_size: int, pipeline_stages: int, num_layers: int) -> int:
    """Return the data-parallel size of a pipeline x data layout; ValueError naming the fix for an impossible one.

    DeepSpeed would otherwise fail later with a RuntimeError inside PipelineModule (world not divisible) or build
    empty stages (more stages than layers).
    """
    topology = Topology(world_size, pipeline_stages).check()
    if pipeline_stages > num_layers:
        raise ValueError(f"pipeline.stages={pipeline_stages} exceeds the model's {num_layers} pipeline layers: "
                         f"use at most {num_layers} stages or a deeper model")
    return topology.data


def split_sizes(config: dict) -> tuple[int, int, int]:
    """(tensor, sequence, expert) parallel sizes a DeepSpeed dict asks for, 1 where it asks for none (or for a
    value that is not a positive integer: the lint names that)."""
    tensor = config.get("tensor_parallel")
    expert = config.get("expert_parallel")
    sizes = (tensor.get("autotp_size", 1) if isinstance(tensor, dict) else 1, config.get("sequence_parallel_size", 1),
             expert.get("autoep_size", 1) if isinstance(expert, dict) and expert.get("enabled") else 1)
    return tuple(s if isinstance(s, int) and not isinstance(s, bool) and s >= 1 else 1  # type: ignore[return-value]
                 for s in sizes)
