"""`bigtrain estimate`: the memory table for a model from the zoo, and the fastest setup that fits (the command's
flags and usage: bigtrain/estimate/arguments.py).

The model's shape comes from `bigtrain.models.build` and `bigtrain.estimate.shape` (parameters counted on the meta
device, activations from the memory model's formula or counted from a meta-device forward); the table, the rules a
split is held to and the recommendation are here.
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bigtrain.config.flags import shorthand_sets
from bigtrain.estimate.memory_model import (PRECISIONS, MemoryEstimate, ModelShape, Setup, estimate,
                                            gathers_for_generation, parse_memory)
from bigtrain.estimate.recommend import all_setups, fits, recommend
from bigtrain.estimate.shape import meta_module, shape_from_spec

if TYPE_CHECKING:  # torch is imported where it is used: `bigtrain estimate --help` starts without it
    from bigtrain.models.spec import ModelSpec


def parse_gpu_mem(text: str, what: str = "--gpu-mem") -> int:
    """Bytes of a memory size; a bare number is GB (`--gpu-mem 80` = 80 GB, as GPUs are sold), units as
    `parse_memory` (80GB = 80e9, 80GiB / 80G = 80 * 2**30)."""
    if isinstance(text, str) and re.fullmatch(r"\s*[0-9]*\.?[0-9]+\s*", text):
        text = text.strip() + "GB"
    return parse_memory(text, what)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def format_table(rows: list[MemoryEstimate], gpu_mem: float, cpu_mem: float | None, headroom: float) -> str:
    """One line per setup: the device terms, the device peak and the host / NVMe needs, in GiB."""
    head = (f"{'setup':<32}{'params':>8}{'grads':>8}{'optim':>8}{'buffers':>9}{'acts':>8}"
            f"{'GPU/rank':>10}{'CPU/node':>10}{'NVMe/node':>11}  fits")
    lines = [head + f" {_gib(gpu_mem)} GiB", "-" * (len(head) + 12)]
    for e in rows:
        extra = e.buffers + e.live_params + e.step_transient
        ok = "yes" if fits(e, gpu_mem, cpu_mem, headroom) else "no"
        held = e.params + e.reference + e.frozen
        lines.append(f"{e.setup.label:<32}{_gib(held):>8}{_gib(e.grads):>8}{_gib(e.optimizer):>8}{_gib(extra):>9}"
                     f"{_gib(e.activations):>8}{_gib(e.device_peak):>10}{_gib(e.host_per_node):>10}"
                     f"{_gib(e.nvme * e.setup.gpus_per_node):>11}  {ok}")
    return "\n".join(lines)


def run_settings(best: Setup, model_overrides: dict[str, Any], tiled_setting: str = "auto") -> str:
    """The run-config overrides that select `best` (and the model the estimate was for)."""
    where = {"seq_len": "data.seq_len", "pretrained": "model.pretrained"}
    sets = [f"{where.get(k, 'model.overrides.' + k)}={v}" for k, v in model_overrides.items()]
    sets += [f"zero.stage={best.zero_stage}", f"precision={best.precision}", f"batch.micro_batch={best.micro_batch}"]
    sets += [f"batch.grad_accum={best.grad_accum}"] if best.grad_accum > 1 else []
    sets += [f"parallel.{name}={size}" for name, size in (("tensor", best.tensor), ("sequence", best.sequence),
                                                          ("expert", best.expert)) if size > 1]
    if best.offload_optimizer != "none":
        sets.append(f"offload.optimizer={best.offload_optimizer}")
    if best.offload_param != "none":
        sets.append(f"offload.param={best.offload_param}")
    if best.checkpointing:
        sets.append("activation_checkpointing.enabled=true")
    if best.lora_r:
        sets.append(f"lora.r={best.lora_r}")
    if best.muon:
        sets.append("optimizer.name=muon")
    if tiled_setting != "auto":
        sets.append(f"activation_checkpointing.tiled_mlp={tiled_setting}")
    if best.offload_hidden_states and best.checkpointing:
        sets.append("activation_checkpointing.offload_hidden_states=true")
    return " ".join(f"--set {s}" for s in sets)


def check_split_sizes(spec: ModelSpec, tensor: int, sequence: int, expert: int = 1) -> None:
    """The rules `bigtrain train` holds these sizes to (the run config's, then the model's), so that no estimate
    recommends what training refuses: ValueError with train's own line."""
    from bigtrain.config.load import load_run_config
    from bigtrain.parallel.split_rules import check_split
    from bigtrain.config.topology import Topology
    sets = [f"model.family={spec.family}", f"parallel.tensor={tensor}", f"parallel.sequence={sequence}",
            f"parallel.expert={expert}"]
    sets += [f"data.seq_len={spec.seq_len}"] if spec.seq_len else []
    sets += [f"model.pretrained={spec.source_dir}"] if spec.source_dir else []
    load_run_config(None, sets)
    check_split(spec, Topology(tensor * sequence * expert, tensor=tensor, sequence=sequence, expert=expert))


# The estimate's shorthand flags: argparse dest -> the run-config field it sets.
ESTIMATE_FLAGS = {"pretrained": "model.pretrained", "seq_len": "data.seq_len", "micro_batch": "batch.micro_batch",
                  "precision": "precision", "tensor": "parallel.tensor", "sequence": "parallel.sequence",
                  "expert": "parallel.expert", "lora_r": "lora.r"}
# The run-config fields the estimate reads; the rest (zero.*, offload.*, ...) it tabulates for every setup.
READS = {"model.family", "model.size", "model.overrides", "model.pretrained", "data.seq_len", "data.image_size",
         "precision", "batch.micro_batch", "batch.grad_accum", "parallel.tensor", "parallel.sequence", "parallel.expert", "lora.r",
         "objective.kind", "objective.reference", "train.loss_impl"}


@dataclass(frozen=True)
class Request:
    """What is estimated: a model of the zoo (family, size, build overrides) and how one rank runs it."""

    family: str
    size: str
    overrides: dict[str, Any]
    precision: str
    micro_batch: int
    tensor: int
    sequence: int
    lora_r: int
    expert: int = 1
    objective: str = ""  # objective.kind when the run config names one ("": the default)
    rows: int = 1  # rows a sample puts through the model (the objective's: a preference pair's two)
    reference: str = "none"  # the objective's reference, resolved as training resolves it
    loss_impl: str = "auto"  # train.loss_impl: auto and chunked compute the loss over chunks of the logits on a GPU
    chunked_allowed: bool = True  # whether the objective allows the chunked loss
    frozen_params: int = 0  # the parameters of the frozen models the objective holds beside the policy
    generates: bool = False  # the objective samples completions before its loss
    completion_tokens: int = 0  # the tokens its completions take (Needs.completion_tokens), when it generates
    gathers_weights: bool | str = False  # at ZeRO-3, whether its rounds gather the whole weights (Needs)
    pretrained: str | None = None  # model.pretrained as given (a Hub name; overrides hold its shape's directory)
    training: str = ""  # the rate, weight decay and schedule the recommended command trains with, and whence
    training_sets: tuple[str, ...] = ()  # the user's own of those, carried into the recommended command
    grad_accum: int = 1  # batch.grad_accum: micro-batches a step; an objective that generates answers them in one round


def request_from_args(args: argparse.Namespace) -> Request:
    """The run config of `--config`, the flags and `--set`, as training loads it; only the fields given count
    (a default data.seq_len is not the model's length)."""
    from bigtrain.config.load import field_sources, load_run_config
    from bigtrain.models import modality
    sets = shorthand_sets(args) + [f"{key}={getattr(args, dest)}" for dest, key in ESTIMATE_FLAGS.items()
                                   if getattr(args, dest) is not None] + list(args.set)
    run = load_run_config(args.config, sets)
    given = field_sources(args.config, sets)
    if "model.family" not in given:
        raise ValueError("--model is missing: give a family (--model NAME or --set model.family=NAME; "
                         "see `bigtrain models`)")
    model = run.model
    if "model.size" not in given and not model.pretrained:
        raise ValueError("--size is missing: give a named size (see `bigtrain models`), or --set model.pretrained=DIR")
    overrides = dict(model.overrides)
    if model.pretrained:  # its shape: a local directory, or a Hub model's config.json (`bigtrain.models.hub`)
        from bigtrain.models.hub import shape_dir
        overrides["pretrained"] = shape_dir(model.pretrained, model.revision)
    image = modality(model.family, overrides) == "image"
    if "data.seq_len" in given:
        if image:
            raise ValueError(f"--seq-len applies to token models; {model.family} takes --set data.image_size=N")
        overrides["seq_len"] = run.data.seq_len
    if "data.image_size" in given and image:
        overrides["image_size"] = run.data.image_size
    micro = run.batch.micro_batch
    if micro == "auto":
        raise ValueError("batch.micro_batch=auto: the estimate tabulates a given micro-batch; give --micro-batch N")
    from bigtrain.config import provenance
    carried = [f for f in provenance.KEPT_ON_RESUME if f in given]  # what the command must say to train as asked
    # the objective's own settings too (its rewards, beta, ...): without them the command trains something else, or
    # is refused (an online objective without a reward)
    carried += [f for f in given if f.startswith("objective.") and f not in ("objective.kind", "objective.reference")]
    ignored = sorted(set(given) - READS - set(carried))
    if ignored:
        print(f"note: not read by the estimate, which tabulates every setup: {', '.join(ignored)}", file=sys.stderr)
    from bigtrain.estimate.shape import frozen_params
    from bigtrain.objectives import resolve_reference
    needs = run.objective.declared
    from bigtrain.objectives import batch_problem
    accum = run.batch.grad_accum or 1
    problem = batch_problem(run.objective.kind, needs, per_rank=(micro or 1, accum),
                            seq_len=run.data.seq_len if "data.seq_len" in given else None)
    if problem:  # the estimate's command trains micro-batch x accumulation as given: training would refuse it
        raise ValueError(problem)
    return Request(model.family, model.size, overrides, "bf16" if run.precision == "auto" else run.precision,
                   micro or 1, run.parallel.tensor, run.parallel.sequence, run.lora.r, run.parallel.expert,
                   run.objective.kind if "objective.kind" in given else "", needs.rows_per_sample,
                   resolve_reference(needs, run.objective.reference, run.lora.r > 0), run.train.loss_impl,
                   needs.allows("chunked_loss"), frozen_params(run.objective, overrides.get("seq_len")),
                   needs.generates, needs.completion_tokens if needs.generates else 0, needs.gathers_weights,
                   model.pretrained,
                   provenance.describe(run, provenance.provenance(given, frozenset())),
                   tuple(set_text(f, provenance.value(run, f)) for f in carried), accum)


def set_text(key: str, value: Any) -> str:
    """KEY=VALUE as `--set` reads it back (a list as [a,b], quoted for the shell where it has brackets or spaces)."""
    if isinstance(value, (list, tuple)):
        value = "[" + ",".join(map(str, value)) + "]"
    text = f"{key}={str(value).lower() if isinstance(value, bool) else value}"
    return f"'{text}'" if any(c in text for c in "[] ,*") else text


ASSUMED_GPUS, ASSUMED_GPU_MEM = 8, "80GiB"  # an 8 x A100/H100 80 GB node


def assume_machine(args: argparse.Namespace) -> str | None:
    """--num-gpus and --gpu-mem set to an 8 x 80 GiB node where not given, and the line that says so (None when both
    were given): the estimate never reads this machine, which may have no GPU at all."""
    missing = [flag for flag, dest in (("--num-gpus", "num_gpus"), ("--gpu-mem", "gpu_mem"))
               if getattr(args, dest) is None]
    if not missing:
        return None
    args.num_gpus = args.num_gpus or ASSUMED_GPUS
    args.gpu_mem = args.gpu_mem or ASSUMED_GPU_MEM
    import torch
    here = "this machine has no GPU" if not torch.cuda.is_available() else "this machine's GPUs are not read"
    each = "80 GiB" if args.gpu_mem == ASSUMED_GPU_MEM else args.gpu_mem  # a given size as the user wrote it
    give = " and ".join(f"{flag} {'N' if flag == '--num-gpus' else 'SIZE'}" for flag in missing)
    return (f"assumed: {args.num_gpus} GPUs per node, {each} each ({' and '.join(missing)} not given; {here}): "
            f"give {give} for yours")


def run_estimate(args: argparse.Namespace) -> int:
    """Print the table and the recommendation; 0 when a setup fits, 1 when none does."""
    from bigtrain.models import build
    req = request_from_args(args)  # a mistake in the run's flags first: one line, nothing on stdout
    if assumed := assume_machine(args):
        print(assumed)
    gpu_mem = parse_gpu_mem(args.gpu_mem, "--gpu-mem")
    cpu_mem = parse_gpu_mem(args.cpu_mem, "--cpu-mem") if args.cpu_mem else None
    if not 0 <= args.headroom < 1:
        raise ValueError(f"--headroom {args.headroom}: give a fraction in [0, 1), e.g. 0.1")
    spec = build(req.family, req.size, **req.overrides)
    if req.lora_r:
        from bigtrain.config.run_config import LoraConfig
        from bigtrain.parallel.lora import check_lora
        check_lora(spec, LoraConfig(r=req.lora_r))
    check_split_sizes(spec, req.tensor, req.sequence, req.expert)
    meta = meta_module(spec)
    tiled, chunked = lever_decisions(args, req, spec, meta)
    shape = shape_from_spec(spec, req.precision, meta, tiled=tiled, chunked=chunked)  # counted with training's levers
    base = base_setup(args, req, spec, shape, tiled, chunked)
    # Muon at ZeRO-0 trains another curve under the default clipping and training refuses it (config.rules)
    rows = [estimate(shape, s) for s in all_setups(base) if not (s.muon and s.zero_stage == 0)]
    seq = f", seq {shape.seq_len}" if shape.seq_len else ""
    print(f"{req.family} {req.size}: {shape.num_params / 1e6:,.1f}M parameters, {base.world_size} ranks "
          f"({args.num_gpus} per node x {args.num_nodes} nodes), {req.precision}, micro-batch {req.micro_batch}{seq}"
          + (f", LoRA r={req.lora_r}: {sum(shape.adapter_numels(req.lora_r)) / 1e6:,.2f}M adapter parameters train"
             if req.lora_r else "")
          + objective_line(req))
    print(format_table(rows, gpu_mem, cpu_mem, args.headroom))
    print_notes(base, shape)
    from bigtrain.estimate.vision import image_line, image_side
    if spec.modality == "vision":
        import torch
        print(image_line(image_side(spec, torch.float32 if PRECISIONS[req.precision] == 4 else torch.bfloat16)))
    print("GiB. GPU/rank = params + optim + the largest of acts (end of forward), the backward's own peak beside the "
          "gradient buckets (from its first gradient on) and grads + buffers (end of backward); buffers: gradient "
          "buckets, ZeRO-3 live parameters, the step's fp32 gradient.\n"
          f"fits: GPU/rank <= {100 * (1 - args.headroom):.0f}% of --gpu-mem"
          + (" and CPU/node of --cpu-mem" if cpu_mem else ""))
    best = recommend(rows, gpu_mem, cpu_mem, args.headroom)
    print_objective_terms(best or min(rows, key=lambda e: e.device_peak))
    if best is None:
        smallest = min(rows, key=lambda e: e.device_peak)
        print(f"nothing fits: the smallest setup ({smallest.setup.label}) needs {_gib(smallest.device_peak)} GiB per "
              "GPU; use more GPUs, a smaller --micro-batch or --seq-len, or NVMe offload", file=sys.stderr)
        split = sequence_split_that_fits(shape, base, gpu_mem, cpu_mem, args.headroom, spec)
        if split is not None:
            print(f"activations, not model states, are what does not fit: split each sequence over "
                  f"{split.setup.sequence} ranks (--set parallel.sequence={split.setup.sequence}): {split.setup.label} "
                  f"needs {_gib(split.device_peak)} GiB per GPU", file=sys.stderr)
        return 1
    print(f"recommended: {best.setup.label} ({_gib(best.device_peak)} GiB of {_gib(gpu_mem)} GiB per GPU"
          + (f", {_gib(best.host_per_node)} GiB CPU per node" if best.host else "") + ")")
    objective = f" --set objective.kind={req.objective}" if req.objective else ""
    if req.reference == "precomputed":  # the one reference the default does not choose
        objective += " --set objective.reference=precomputed"
    objective += "".join(f" --set {s}" for s in req.training_sets)
    print(f"  bigtrain train --model {req.family} --size {req.size} "
          f"{run_settings(best.setup, {**req.overrides, **_given(req)}, args.tiled_mlp)}{objective}")
    print(f"  which trains with {req.training}")
    return 0


def _given(req: Request) -> dict[str, Any]:
    return {"pretrained": req.pretrained} if req.pretrained else {}


def print_notes(base: Setup, shape: ModelShape) -> None:
    """What the table's terms hold beyond the policy: its frozen models, the loss's form."""
    if base.frozen_params:
        print(f"params include the objective's frozen models ({base.frozen_params / 1e6:,.1f}M parameters), "
              "partitioned like the policy's at ZeRO-3")
    if base.reference == "copy":
        print("params include the frozen reference model (objective.reference=copy): its weights, partitioned like "
              "the policy's at ZeRO-3; with LoRA, objective.reference=adapters_off (the default) holds no copy; "
              "objective.reference=precomputed holds none while training")
    if shape.vocab:
        print("loss: " + ("over chunks of the logits (train.loss_impl=auto on a GPU; plain keeps them whole)"
                          if base.chunked_loss else "the plain cross-entropy over the whole logits"))
    if base.reference == "precomputed":
        print("objective.reference=precomputed: a frozen copy computes the reference's log-probabilities before "
              "training (forward passes only) and is freed; training holds no reference model")


def print_objective_terms(e: MemoryEstimate) -> None:
    """What the objective holds beside the policy, each its own line (of the recommended setup, else the smallest):
    the reference copy and frozen models (in params), a generation round's KV cache and the weights it gathers."""
    terms = [("reference copy (objective.reference=copy)", e.reference),
             ("frozen models (reward model, teacher)", e.frozen)]
    if e.setup.completion_tokens:
        terms += [(f"KV cache of a generation round ({e.setup.micro_batch * e.setup.grad_accum} rows x "
                   f"{e.setup.completion_tokens} completion tokens + prompt)", e.kv_cache),
                  ("weights gathered for generation (ZeRO-3, objective.ds3_gather_for_generation)", e.gathered)]
    shown = [(what, n) for what, n in terms if n or e.setup.completion_tokens]
    if shown:
        print(f"objective's terms at {e.setup.label}, GiB per rank:")
        for what, n in shown:
            print(f"  {what:<80}{_gib(n):>8}")
    if e.setup.completion_tokens:
        print("  a generation round precedes the step's forward: GPU/rank is the larger of it (KV cache + gathered "
              "weights) and the step")


def objective_line(req: Request) -> str:
    """What the objective adds to a sample: its rows, its reference."""
    said = ([f"{req.rows} rows a sample"] if req.rows > 1 else []) + (
        [f"reference {req.reference}"] if req.reference != "none" else [])
    return f"; objective {req.objective}: {', '.join(said)}" if said else ""


def lever_decisions(args: argparse.Namespace, req: Request, spec: ModelSpec, meta: Any) -> tuple[bool, bool]:
    """(tiled MLP, chunked loss) as training resolves them for this request (`bigtrain.config.rules`,
    `bigtrain.train.fast_path`; `meta`: the model on the meta device)."""
    from bigtrain.config.rules import tiled_mlp_wanted
    from bigtrain.train.fast_path import resolve_loss_impl
    tokens = (spec.seq_len or 0) // req.sequence
    return (tiled_mlp_wanted(_tri_state(args.tiled_mlp), tokens, spec.hidden_size),
            resolve_loss_impl(req.loss_impl, "cuda", spec, meta, req.tensor, req.chunked_allowed) == "chunked")


def base_setup(args: argparse.Namespace, req: Request, spec: ModelSpec, shape: ModelShape, tiled: bool,
               chunked: bool) -> Setup:
    """The request's setup on the machine of the flags, with the ALST levers and the loss resolved by training's
    own rules (`lever_decisions`; the hidden states' offload by `bigtrain.config.rules` too)."""
    from bigtrain.config.rules import offload_hidden_states_wanted
    tokens, hidden = (spec.seq_len or 0) // req.sequence, spec.hidden_size
    offload = shape.mlp_layers > 0 and offload_hidden_states_wanted(_tri_state(args.offload_hidden_states),
                                                                    "accelerator", True, tokens, hidden)
    return Setup(world_size=args.num_gpus * args.num_nodes, gpus_per_node=args.num_gpus, precision=req.precision,
                 micro_batch=req.micro_batch, grad_accum=req.grad_accum, tensor=req.tensor, sequence=req.sequence, expert=req.expert,
                 lora_r=req.lora_r, tiled_mlp=tiled and shape.mlp_layers > 0, offload_hidden_states=offload,
                 muon=args.optimizer == "muon", rows_per_sample=req.rows, reference=req.reference,
                 frozen_params=req.frozen_params, chunked_loss=chunked, completion_tokens=req.completion_tokens,
                 gather_for_generation=gathers_for_generation(req.gathers_weights,
                                                              PRECISIONS[req.precision] * shape.num_params,
                                                              parse_gpu_mem(args.gpu_mem, "--gpu-mem")))


def sequence_split_that_fits(shape: ModelShape, base: Setup, gpu_mem: float, cpu_mem: float | None,
                             headroom: float, spec: ModelSpec) -> MemoryEstimate | None:
    """The fastest setup that fits with the smallest sequence-parallel size that makes one fit (sizes dividing the
    ranks that training accepts for this model: `check_split_sizes`), when its states alone fit and activations do
    not."""
    seq_len = spec.seq_len or shape.seq_len
    if not seq_len or base.sequence > 1:
        return None
    size = 2
    while size <= base.world_size // base.tensor:
        if (base.world_size // base.tensor) % size == 0 and _splits(spec, base.tensor, size):
            from dataclasses import replace
            best = recommend([estimate(shape, s) for s in all_setups(replace(base, sequence=size))], gpu_mem,
                             cpu_mem, headroom)
            if best is not None:
                return best
        size *= 2
    return None


def _splits(spec: ModelSpec, tensor: int, sequence: int) -> bool:
    try:
        check_split_sizes(spec, tensor, sequence)
    except ValueError:
        return False
    return True


def _tri_state(text: str) -> bool | str:
    """--tiled-mlp / --offload-hidden-states: "true" / "false" as booleans, "auto" as it is."""
    return {"true": True, "false": False}.get(text, text)
