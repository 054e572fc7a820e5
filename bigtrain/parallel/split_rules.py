"""Whether a model can be split as a topology asks, before any rank builds it: the family's modes, the heads, the
attention. One line each (ValueError), worded as the run config's fields; `bigtrain train`, `bigtrain lint` (with a
family named) and `bigtrain estimate` hold a split to these same rules."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from bigtrain.models.spec import ModelSpec
from bigtrain.config.topology import Topology


def check_split_layout(run: Any, topology: Topology, family_given: bool = True) -> str | None:
    """ValueError (one line) when the sizes the resolved DeepSpeed dict asks for break a rule of the run config or
    a mode the family does not have: a size from the user's JSON (tensor_parallel.autotp_size, ...) is judged
    like the same size given with --set, before any data or model is built.

    `family_given=False` (`bigtrain lint` with no model named): the run config's default family is nobody's
    choice, so its modes are not held against the JSON; returns the note naming what naming one would add."""
    replace(run, pipeline=replace(run.pipeline, stages=topology.pipeline),  # re-runs the run config's own rules
            parallel=replace(run.parallel, tensor=topology.tensor, sequence=topology.sequence,
                             expert=topology.expert))
    if family_given:
        check_family_modes(run.model.family, topology)
        return None
    split = [f"{mode}={size}" for mode, size in topology.axes.items() if mode != "pipeline" and size > 1]
    if not split:
        return None
    return (f"no model named: the split ({', '.join(split)}) is judged as DeepSpeed judges the JSON; --model FAMILY "
            "(or --set model.family=FAMILY) adds that family's rules: whether DeepSpeed can split it so "
            "(AutoTP's sharding plans, Ulysses' sdpa attention, AutoEP's presets)")


def check_family_modes(family_name: str, topology: Topology) -> None:
    """ValueError (one line) for a split the family has no mode for."""
    if topology.pipeline <= 1 and all(size <= 1 for mode, size in topology.axes.items() if mode != "pipeline"):
        return  # nothing split: the family's module (transformers' classes, ~2.5 CPU s to import) is not needed
    from bigtrain.models.registry import family
    modes = family(family_name).parallel
    if topology.pipeline > 1 and "pipeline" not in modes:
        raise ValueError(f"pipeline.stages={topology.pipeline}: the {family_name} family is not cut into pipeline "
                         f"stages (it supports {', '.join(sorted(modes))}); set pipeline.stages=1 (ZeRO-3 partitions "
                         "it instead)")
    for mode, size in topology.axes.items():
        if mode != "pipeline" and size > 1 and mode not in modes:
            raise ValueError(f"parallel.{mode}={size}: the {family_name} family does not support {mode} "
                             f"parallelism (it supports {', '.join(sorted(modes))}); {_why_not(mode)}")


def kv_heads_line(spec: ModelSpec, topology: Topology) -> str | None:
    """DeepSpeed's AutoTP warns in the rank's log only when a tensor group outnumbers the key-value heads."""
    config = getattr(spec.config, "get_text_config", lambda: spec.config)()
    kv_heads = getattr(config, "num_key_value_heads", None)
    if kv_heads is None or topology.tensor <= kv_heads:
        return None
    return (f"parallel.tensor={topology.tensor} with the model's {kv_heads} key-value heads: DeepSpeed's AutoTP "
            f"gives the ranks beyond {kv_heads} no attention shard of their own, so attention does not get faster "
            f"past parallel.tensor={kv_heads} (training is correct either way)")


def check_split(spec: ModelSpec, topology: Topology) -> None:
    """ValueError (one line) for a model that cannot be split as asked: the family, the heads, the attention."""
    check_family_modes(spec.family, topology)
    config = getattr(spec.config, "get_text_config", lambda: spec.config)()
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", heads)
    for mode, size in (("tensor", topology.tensor), ("sequence", topology.sequence)):
        if size > 1 and heads is not None and heads % size:
            raise ValueError(f"parallel.{mode}={size}: the model's {heads} attention heads do not divide by {size}; "
                             f"choose parallel.{mode} dividing {heads}")
    if topology.tensor > 1 and topology.sequence > 1 and heads is not None:
        kv_heads = _tensor_sequence_heads(heads, kv_heads, topology)
    if topology.expert > 1:
        from bigtrain.parallel.experts import expert_problem
        problem = expert_problem(spec.config, topology.expert)
        if problem:
            raise ValueError(problem)
    if topology.sequence > 1:
        if kv_heads is not None and kv_heads % topology.sequence and topology.sequence % kv_heads:
            raise ValueError(f"parallel.sequence={topology.sequence}: the model's {kv_heads} key-value heads neither "
                             f"divide by it nor divide it (Ulysses splits or repeats them); choose another size")
        attention = getattr(config, "_attn_implementation", None)
        if attention not in (None, "sdpa"):
            raise ValueError(f"parallel.sequence={topology.sequence}: Ulysses wraps sdpa attention, and this model "
                             f"uses {attention}; set model.overrides.attn_implementation=sdpa (or parallel.sequence=1)")


def _tensor_sequence_heads(heads: int, kv_heads: int | None, topology: Topology) -> int | None:
    """The key-value heads one tensor rank holds, which Ulysses splits within it; ValueError (one line) where the
    heads do not split so."""
    split = f"parallel.tensor={topology.tensor} x parallel.sequence={topology.sequence}"
    if heads % (topology.tensor * topology.sequence):
        raise ValueError(f"{split}: the model's {heads} attention heads do not divide by "
                         f"{topology.tensor * topology.sequence} (Ulysses splits each tensor shard's heads); choose "
                         "sizes whose product divides them")
    if kv_heads is not None and kv_heads % topology.tensor:
        raise ValueError(f"{split}: the model's {kv_heads} key-value heads do not divide by parallel.tensor="
                         f"{topology.tensor} (each tensor shard must hold whole key-value heads for Ulysses to split "
                         "them); choose parallel.tensor dividing them")
    return None if kv_heads is None else kv_heads // topology.tensor


def _why_not(mode: str) -> str:
    if mode == "tensor":
        return "DeepSpeed's AutoTP has no sharding plan for it; use ZeRO-3 (states) or a Llama-family model"
    if mode == "expert":
        return ("DeepSpeed's AutoEP replaces the mixture-of-experts blocks of the models it has presets for "
                "(Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3...); use ZeRO to partition other models' weights")
    return "Ulysses needs a decoder with sdpa attention; use a Llama-family model or a Hugging Face decoder"
