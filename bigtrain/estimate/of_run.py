"""The memory of one run config as it would train: its model built (shape only), its own setup (ZeRO stage,
offload, checkpointing, splits, LoRA, objective) at a world size, estimated by the memory model. `bigtrain
preflight` (the launcher's memory check) and `bigtrain recipes` ask it; `bigtrain estimate` tabulates every setup
instead.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from bigtrain.estimate.memory_model import PRECISIONS, MemoryEstimate, estimate, gathers_for_generation, setup_from_run

if TYPE_CHECKING:
    from bigtrain.config.run_config import RunConfig
    from bigtrain.models.spec import ModelSpec


def estimate_run(run: RunConfig, world: int, gpus_per_node: int, device_name: str = "cuda",
                 gpu_mem: float | None = None) -> tuple[MemoryEstimate, ModelSpec]:
    """The estimate of `run` on `world` ranks (`gpus_per_node` per node) of `device_name`, and the model's spec.
    The model's overrides are the runner's (`bigtrain.train.inputs.overrides_for_run`, from the run config alone:
    a tokenizer named is not loaded, so its vocabulary is the model's default); a Hub model.pretrained is its shape
    alone (`bigtrain.models.hub.shape_dir`: the shapes bigtrain ships, else its config.json). `gpu_mem`: a device's
    bytes, which decide objective.ds3_gather_for_generation=auto (unknown: counted gathered)."""
    from bigtrain.estimate.shape import frozen_params, meta_module, shape_from_spec
    from bigtrain.models import build
    from bigtrain.models.hub import shape_dir
    from bigtrain.train.fast_path import resolve_loss_impl
    from bigtrain.train.inputs import overrides_for_run
    if run.model.pretrained:
        run = replace(run, model=replace(run.model, pretrained=shape_dir(run.model.pretrained, run.model.revision),
                                         revision=None))
    overrides = overrides_for_run(run, None, device_name)
    if run.objective.declared.head == "scalar":  # estimated as the causal LM it is built from, as `bigtrain estimate`
        # does: a classifier's forward finds each row's last token by value, which the meta device cannot read, and
        # the one-label head holds less than the vocabulary's
        overrides = {k: v for k, v in overrides.items() if k not in ("task", "num_classes", "pad_token_id")}
    spec = build(run.model.family, run.model.size, **overrides)
    meta = meta_module(spec)
    chunked = resolve_loss_impl(run.train.loss_impl, device_name, spec, meta, run.parallel.tensor,
                                run.objective.declared.allows("chunked_loss")) == "chunked"
    setup = setup_from_run(run, world, gpus_per_node, spec.hidden_size, chunked,
                           frozen_params(run.objective, run.data.seq_len))
    setup = replace(setup, gather_for_generation=gathers_for_generation(
        run.objective.declared.gathers_weights, PRECISIONS[setup.precision] * spec.num_params, gpu_mem))
    # activations counted with the levers it trains with
    shape = shape_from_spec(spec, run.precision, meta, tiled=setup.tiled_mlp, chunked=chunked)
    return estimate(shape, setup), spec
