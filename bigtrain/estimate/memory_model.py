"""Memory model per rank for each ZeRO stage x offload x activation checkpointing. Pure functions.

Model states follow the ZeRO paper (Rajbhandari et al. 2020) for mixed-precision Adam:
P bytes per parameter and per gradient (P = 2 in bf16/fp16, 4 in fp32) and K bytes of
optimizer state (fp32 master copy 4 + Adam moments 8, so K = 12), with N data-parallel ranks:

    stage 0: (P + P + K) * psi          stage 2: P * psi + (P + K) * psi / N
    stage 1: (P + P) * psi + K * psi / N  stage 3: (P + P + K) * psi / N

as DeepSpeed 0.19 lays them out (checked against tensor counts in tests/test_estimate.py):
in fp32 a ZeRO stage >= 1 still keeps an fp32 master copy of its partition (K = 12), while
stage 0 in fp32 updates the parameters in place (K = 8). Offloading the optimizer moves K
and the fp32 gradient partition to the host; offloading parameters (stage 3) moves the
parameter partition too. DeepSpeed's gradient buckets, ZeRO-3's gathered ("live")
parameters and the fp32 gradient made for the optimizer step are separate terms.

Activations for transformer layers follow Korthikanti et al. 2022: per layer and sample
s*h*(c_h*e + m_h) + a*s^2*(c_s*e + m_s) bytes (e: bytes per value, masks 1 byte; Megatron's
layer has c_h=16, c_s=2, m_h=2, m_s=1, i.e. 34sbh + 5as^2b in 16 bit). bigtrain's own
layers' coefficients were counted from the tensors they save for backward. Full checkpointing keeps each block's input
(s*h*e) and recomputes one block at a time.

Tensor parallelism (t ranks per layer) divides the linear layers' weights and their states by t (AutoTP keeps the
embeddings and norms whole on every rank: `ModelShape.tensor_whole_params`), and a layer's activations as
Korthikanti's 10sbh + 24sbh/t (the layer's input, norms and residuals stay whole on every rank); ZeRO then
partitions over the data-parallel ranks. Sequence parallelism (Ulysses, u ranks) divides every activation by u
(each rank holds its slice of the sequence), and ZeRO partitions over the data x sequence ranks.

LoRA (rank r) adds r x (in + out) parameters per adapted linear layer and freezes the rest: the frozen base keeps
its P bytes per parameter (partitioned at stage 3, with no fp32 copy), while gradients and the K bytes of
optimizer state exist for the adapters alone (bigtrain.parallel.lora gives the optimizer nothing else).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from bigtrain.config.rules import (Layout, check_layout, offload_hidden_states_wanted,
                                   tiled_mlp_wanted)
from bigtrain.config.run_config import RunConfig, ZeroConfig
from bigtrain.config.topology import Topology
from bigtrain.estimate.activations import (ActivationCount, ModelShape, activations_per_sample, chunked_loss_bytes,
                                           chunked_loss_margin)

_ZERO = ZeroConfig()  # bucket defaults come from the run config, the one place settings live
PRECISIONS = {"fp32": 4, "bf16": 2, "fp16": 2}

# Offload placements in the order they cost speed: (optimizer, param).
OFFLOADS = (("none", "none"), ("cpu", "none"), ("nvme", "none"), ("cpu", "cpu"), ("nvme", "nvme"))

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def parse_memory(text: str | int | float, what: str = "memory") -> int:
    """'80GB' -> 80e9, '80GiB' -> 80 * 2**30, '24G' -> 24 * 2**30 (a bare letter is binary, as in
    `free -g`), '1.5TB', '512MiB', or a plain number of bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{what} {text!r} is not a memory size; write it like 80GB, 80GiB, 24G or 512MiB")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"{what} {text!r} must be positive")
    return int(value)


@dataclass(frozen=True)
class Setup:
    """One training configuration to estimate."""

    world_size: int
    gpus_per_node: int = 1
    zero_stage: int = 0
    precision: str = "bf16"
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_param: str = "none"  # none | cpu | nvme (stage 3 only)
    checkpointing: bool = False
    micro_batch: int = 1
    grad_accum: int = 1  # > 1 keeps gradients alive through the next micro-batch's forward
    reduce_bucket_size: int = _ZERO.reduce_bucket_size  # elements
    overlap_comm: bool = _ZERO.overlap_comm
    prefetch_bucket_size: int = _ZERO.prefetch_bucket_size
    param_persistence_threshold: int = _ZERO.param_persistence_threshold
    tensor: int = 1  # tensor-parallel ranks per layer (AutoTP)
    sequence: int = 1  # sequence-parallel ranks per sample (Ulysses)
    lora_r: int = 0  # LoRA rank (lora.r): > 0 trains adapters only, on a frozen base
    tiled_mlp: bool = False  # ALST's tiled MLP (activation_checkpointing.tiled_mlp, resolved)
    expert: int = 1  # expert-parallel ranks (AutoEP): each keeps 1/expert of the experts
    offload_hidden_states: bool = False  # ALST: checkpointed block inputs in host memory (with checkpointing)
    muon: bool = False  # optimizer.name=muon: one fp32 momentum per Muon-trained parameter instead of Adam's two
    rows_per_sample: int = 1  # rows a sample puts through the model (the objective's: a preference pair's two)
    reference: str = "none"  # the objective's reference, resolved: copy = a frozen second model; none / adapters_off
    frozen_params: int = 0  # the parameters of the frozen models an objective holds beside the policy (a teacher)
    chunked_loss: bool = False  # the loss over chunks of the logits (train.loss_impl, resolved as training does)
    # an objective that generates (Needs.generates): the tokens its completions take (Needs.completion_tokens; 0:
    # none), and whether its rounds gather the whole weights at ZeRO-3 (Needs.gathers_weights, auto resolved)
    completion_tokens: int = 0
    gather_for_generation: bool = False

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r}: use one of {', '.join(PRECISIONS)}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero stage {self.zero_stage}: allowed 0, 1, 2, 3")
        if self.lora_r < 0:
            raise ValueError(f"LoRA rank {self.lora_r}: must be >= 0 (0 trains every weight)")
        if min(self.world_size, self.gpus_per_node, self.micro_batch, self.grad_accum, self.tensor, self.sequence) < 1:
            raise ValueError("world size, GPUs per node, micro batch, gradient accumulation and the tensor / "
                             "sequence sizes must be >= 1")
        self.topology.check()
        for name in ("offload_optimizer", "offload_param"):
            if getattr(self, name) not in ("none", "cpu", "nvme"):
                raise ValueError(f"{name}={getattr(self, name)!r}: use none, cpu or nvme")
        check_layout(Layout(self.zero_stage, self.offload_optimizer, self.offload_param))

    @property
    def label(self) -> str:
        off = [f"opt-{self.offload_optimizer}"] if self.offload_optimizer != "none" else []
        off += [f"param-{self.offload_param}"] if self.offload_param != "none" else []
        split = "".join(f"+{short}{size}" for short, size in (("tp", self.tensor), ("sp", self.sequence),
                                                               ("ep", self.expert)) if size > 1)
        return (f"zero{self.zero_stage}" + "".join(f"+{o}" for o in off) + ("+ckpt" if self.checkpointing else "")
                + ("+tiled" if self.tiled_mlp else "")
                + ("+offload-hs" if self.offload_hidden_states and self.checkpointing else "")
                + split + ("+ref" if self.reference == "copy" else "") + ("+frozen" if self.frozen_params else ""))

    @property
    def topology(self) -> Topology:
        return Topology(self.world_size, tensor=self.tensor, sequence=self.sequence, expert=self.expert)

    @property
    def zero_ranks(self) -> int:
        """The ranks ZeRO partitions over: data x sequence (a tensor group's ranks hold other shards)."""
        return self.topology.zero_ranks


def setup_from_run(run: RunConfig, world_size: int, gpus_per_node: int, hidden: int = 0,
                   chunked_loss: bool = False, frozen_params: int = 0) -> Setup:
    """The Setup a run config trains with at `world_size` ranks (pipeline stages not modelled); `hidden` (the
    model's width) resolves activation_checkpointing.tiled_mlp=auto as the engine does; `chunked_loss`: train.loss_impl
    resolved for the model (bigtrain.train.fast_path.resolve_loss_impl); the objective's rows and reference as
    it declares them, `frozen_params` those of its frozen models (bigtrain.estimate.shape.frozen_params)."""
    from bigtrain.ds.generate import batch_triple
    from bigtrain.objectives import resolve_reference
    needs = run.objective.declared
    triple = batch_triple(run, world_size)
    z = run.zero
    # The estimate is for accelerator memory, where `precision: auto` means bf16 (bigtrain.distributed.device).
    precision = "bf16" if run.precision == "auto" else run.precision
    split = Topology.of_run(run.parallel, 1, world_size).model_split
    return Setup(world_size=triple.dp_size * split, gpus_per_node=gpus_per_node, zero_stage=z.stage,
                 tensor=run.parallel.tensor, sequence=run.parallel.sequence, expert=run.parallel.expert,
                 muon=run.optimizer.name == "muon",
                 lora_r=run.lora.r,
                 tiled_mlp=run.pipeline.stages == 1 and tiled_mlp_wanted(
                     run.activation_checkpointing.tiled_mlp, run.data.seq_len // run.parallel.sequence, hidden),
                 offload_hidden_states=run.pipeline.stages == 1 and offload_hidden_states_wanted(
                     run.activation_checkpointing.offload_hidden_states, "accelerator",
                     run.activation_checkpointing.enabled, run.data.seq_len // run.parallel.sequence, hidden),
                 precision=precision, offload_optimizer=run.offload.optimizer, offload_param=run.offload.param,
                 chunked_loss=chunked_loss and run.pipeline.stages == 1, rows_per_sample=needs.rows_per_sample,
                 reference=resolve_reference(needs, run.objective.reference, run.lora.r > 0),
                 frozen_params=frozen_params, completion_tokens=needs.completion_tokens if needs.generates else 0,
                 gather_for_generation=gathers_for_generation(needs.gathers_weights, 0, None),
                 checkpointing=run.activation_checkpointing.enabled, micro_batch=triple.micro_batch,
                 grad_accum=triple.grad_accum, reduce_bucket_size=z.reduce_bucket_size, overlap_comm=z.overlap_comm,
                 prefetch_bucket_size=z.prefetch_bucket_size, param_persistence_threshold=z.param_persistence_threshold)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank on the device, on the host and on NVMe, by term."""

    setup: Setup
    params: float
    grads: float
    optimizer: float
    buffers: float  # gradient buckets
    live_params: float  # ZeRO-3 parameters gathered during forward / backward
    step_transient: float  # fp32 gradient made for the optimizer step
    activations: float
    host: float  # offloaded states per rank
    nvme: float
    reference: float = 0.0  # the frozen reference copy's weights on the device (objective.reference=copy)
    frozen: float = 0.0  # the objective's own frozen models' weights on the device (a reward model, a teacher)
    kv_cache: float = 0.0  # a generation round's KV cache (objectives that generate)
    gathered: float = 0.0  # the whole weights gathered on the device for a generation round (ZeRO-3)
    # activations from the first parameter gradient on (a counted model's; None: `activations` covers the backward)
    activations_after_first_gradient: float | None = None

    @property
    def model_states(self) -> float:
        """Parameters, gradients and optimizer states resident on the device."""
        return self.params + self.grads + self.optimizer

    @property
    def grads_in_forward(self) -> float:
        """Gradients alive during a forward: ZeRO-3's gradient partition always, the others only
        while accumulating over micro-batches (a step frees them)."""
        return self.grads if (self.setup.zero_stage == 3 or self.setup.grad_accum > 1) else 0.0

    @property
    def device_peak(self) -> float:
        """Peak bytes on the device: the largest of the end of the forward (all activations), the backward from its
        first parameter gradient on (`backward`, where counted apart) and the end of backward / the step (all
        gradients, buckets, the fp32 step gradient). Backward frees activations as it makes gradients, so the
        first and the last are not added."""
        always = (self.params + self.reference + self.frozen + self.optimizer + self.live_params
                  + (self.buffers if self.setup.zero_stage == 3 else 0.0))
        forward = self.activations + self.grads_in_forward
        step = self.grads + self.step_transient + (self.buffers if self.setup.zero_stage in (1, 2) else 0.0)
        return always + max(forward, step, self.generation, self.backward)

    @property
    def backward(self) -> float:
        """The backward from its first parameter gradient on, where counted apart: what the activations hold then,
        beside ZeRO 1-2's gradient bucket (made at that gradient) or ZeRO-3's gradient partition."""
        if self.activations_after_first_gradient is None:
            return 0.0
        beside = self.buffers if self.setup.zero_stage in (1, 2) else self.grads_in_forward
        return self.activations_after_first_gradient + beside

    @property
    def generation(self) -> float:
        """A generation round's own bytes (before the step's forward, freed before it): its KV cache, the weights
        gathered for it, and ZeRO-3's gradient partition, alive throughout."""
        if not self.setup.completion_tokens:
            return 0.0
        return self.kv_cache + self.gathered + (self.grads if self.setup.zero_stage == 3 else 0.0)

    @property
    def host_per_node(self) -> float:
        return self.host * self.setup.gpus_per_node


def tensor_share(count: float, tensor: int, whole: float = 0.0) -> float:
    """A tensor-parallel rank's share of `count` parameters, `whole` of which every rank keeps whole."""
    return (count - whole) / tensor + whole


def model_state_terms(psi: float, setup: Setup, persistent: float = 0.0,
                      trained: float | None = None, whole: float = 0.0, experts: float = 0.0,
                      muon: float = 0.0) -> dict[str, float]:
    """params / grads / optimizer bytes per rank on the device and on host / NVMe (ZeRO formulas). `psi`: every
    parameter; `trained`: those with gradients and optimizer states (LoRA's adapters; default all); `whole`: those
    a tensor-parallel group keeps whole on each rank (the rest is split over its ranks); `experts`: a mixture of
    experts' experts, of which an expert-parallel rank holds 1/setup.expert (ZeRO partitions the dense weights over
    every rank and the experts over their replicas, so a partitioned term is the same 1/n of all of them)."""
    n, stage, p = setup.zero_ranks, setup.zero_stage, PRECISIONS[setup.precision]
    trained = tensor_share(psi if trained is None else trained, setup.tensor, 0.0 if trained else whole)
    psi, persistent = tensor_share(psi, setup.tensor, whole), persistent / setup.tensor
    held = experts * (1 - 1 / setup.expert)  # the other ranks' experts: never on this one
    mixed = p == 2
    k = (4 if (mixed or stage >= 1) else 0) + 8  # fp32 master copy + Adam's two fp32 moments
    params = p * (psi - held) if stage < 3 else p * psi / n + p * persistent  # persistent: partitioned and whole
    grads = p * (trained - held) if stage < 2 else p * trained / n
    optimizer = k * (trained - held) if stage == 0 else k * trained / n
    momentum_only = 4 * tensor_share(muon, setup.tensor)  # Muon keeps one fp32 momentum where Adam keeps two
    optimizer -= momentum_only if stage == 0 else momentum_only / n
    offloaded = 0.0
    if setup.offload_optimizer != "none":
        # The host keeps master + moments and an fp32 gradient partition; stage 1/2 also a 16-bit
        # copy of its parameter partition. Stage >= 2 sends gradients out of the device bucket by bucket.
        offloaded = ((k + 4) * trained - momentum_only) / n + (p * trained / n if stage < 3 else 0.0)
        optimizer = 0.0
        grads = grads if stage == 1 else 0.0
    if setup.offload_param != "none":
        offloaded += p * psi / n
        params = p * persistent
    host = offloaded if setup.offload_optimizer == "cpu" or setup.offload_param == "cpu" else 0.0
    nvme = offloaded - host
    return {"params": params, "grads": grads, "optimizer": optimizer, "host": host, "nvme": nvme}


def estimate(shape: ModelShape, setup: Setup) -> MemoryEstimate:
    """Per-rank memory of training `shape` under `setup`."""
    stage, p = setup.zero_stage, PRECISIONS[setup.precision]
    adapters = sum(shape.adapter_numels(setup.lora_r))
    if setup.lora_r and not adapters:
        raise ValueError(f"LoRA rank {setup.lora_r}: the {shape.family} shape names no linear layers to adapt")
    psi, trained = shape.num_params + adapters, (adapters or None)
    persistent = shape.persistent_params(setup.param_persistence_threshold, setup.lora_r) if stage == 3 else 0
    whole = 0 if adapters else shape.tensor_whole_params  # LoRA never runs with tensor splits
    terms = model_state_terms(psi, setup, persistent, trained, whole, shape.expert_params if setup.expert > 1 else 0,
                              shape.muon_params if setup.muon and not adapters else 0)
    trained = trained or psi
    buffers = 0.0
    if stage in (1, 2):  # contiguous gradient buckets, double-buffered when overlapping communication
        buffers = (2 if setup.overlap_comm else 1) * setup.reduce_bucket_size * p
    elif stage == 3:
        buffers = setup.reduce_bucket_size * p
    live = 0.0
    if stage == 3:
        largest = shape.largest_layer_params or psi
        live = p * min(psi - persistent, largest + setup.prefetch_bucket_size) / setup.tensor
    transient = 0.0
    if p == 2 or stage >= 1:  # the optimizer steps on an fp32 gradient of its (partition of the) master copy
        transient = 4 * tensor_share(trained, setup.tensor, whole) / (1 if stage == 0 else setup.zero_ranks)
        if setup.offload_optimizer != "none":
            transient = 0.0  # made on the host, inside the offloaded partition counted there
    count = split_activations(activations_per_sample(shape, p, setup.tiled_mlp, setup.chunked_loss), setup)
    layers = shape.n_layer or shape.mlp_layers
    rows = setup.micro_batch * setup.rows_per_sample  # a pair's two answers go through the model together
    offloaded = 0.0
    if setup.offload_hidden_states and setup.checkpointing and layers:
        # DeepSpeed's offload keeps the last block's input on the device (keep_last_count=1), the rest on the host
        offloaded = rows * count.block_inputs * (1 - 1 / layers)
        count = replace(count, block_inputs=count.block_inputs / layers)
    acts = count.total(rows, setup.checkpointing)
    after = count.total_after_first_gradient(rows, setup.checkpointing)
    if setup.chunked_loss and shape.vocab:  # each sequence rank's loss is over its slice: rows x seq / u tokens
        tokens = rows * max(shape.seq_len // setup.sequence, 1)
        loss_bytes = chunked_loss_bytes(shape, p, tokens) + chunked_loss_margin(shape, tokens)
        acts += loss_bytes
        after = None if after is None else after + loss_bytes
    ref_device, ref_host = frozen_terms(shape.num_params if setup.reference == "copy" else 0, setup, persistent)
    frozen_device, frozen_host = frozen_terms(setup.frozen_params, setup)
    return MemoryEstimate(setup=setup, params=terms["params"], grads=terms["grads"], optimizer=terms["optimizer"],
                          buffers=buffers, live_params=live, step_transient=transient, activations=acts,
                          activations_after_first_gradient=after,
                          host=terms["host"] + offloaded + ref_host + frozen_host, nvme=terms["nvme"],
                          reference=ref_device, frozen=frozen_device, kv_cache=kv_cache_bytes(shape, setup),
                          gathered=gathered_bytes(psi - persistent, setup))


def gathers_for_generation(setting: bool | str, weight_bytes: float, gpu_mem: float | None) -> bool:
    """Needs.gathers_weights resolved as a run resolves it (bigtrain.rollout.generate.gather_choice): auto
    gathers where the whole weights take at most GATHER_SHARE of a device (the estimate reads the device's memory, the
    run its free memory at its start); with no device size given, auto counts the gathered weights (the
    larger round, and TRL's default)."""
    if setting != "auto":
        return bool(setting)
    if gpu_mem is None:
        return True
    from bigtrain.rollout.generate import GATHER_SHARE
    return weight_bytes <= GATHER_SHARE * gpu_mem


def kv_cache_bytes(shape: ModelShape, setup: Setup) -> float:
    """A generation round's KV cache on one rank: a round answers the rank's whole step at once (micro_batch x
    grad_accum rows: `OnlineObjective.data_batch` prompts, each num_generations times, in one `generate` call), each
    row up to data.seq_len tokens (its prompt gets seq_len minus the completions' tokens), every layer keeping a key
    and a value of kv_heads x head_dim per token in the training precision. transformers' DynamicCache grows by
    concatenation, so one layer's key is briefly held twice (within 1 / (2 x layers) of this)."""
    if not setup.completion_tokens:
        return 0.0
    rows = setup.micro_batch * setup.grad_accum
    tokens = shape.context or shape.seq_len or setup.completion_tokens
    return float(rows * tokens * shape.kv_per_token * PRECISIONS[setup.precision])


def gathered_bytes(partitioned: float, setup: Setup) -> float:
    """The weights a ZeRO-3 generation round gathers whole on the device (DeepSpeed's unwrap_model_for_generation:
    every partitioned parameter, beside its partition): `partitioned` parameters (all but the persistent ones, which
    are whole already) in the training precision; 0 below ZeRO-3 or with the weights left partitioned."""
    if not (setup.completion_tokens and setup.zero_stage == 3 and setup.gather_for_generation):
        return 0.0
    return float(PRECISIONS[setup.precision] * partitioned)


def frozen_terms(num_params: float, setup: Setup, persistent: float = 0.0) -> tuple[float, float]:
    """(device, host) bytes per rank of frozen models of `num_params` parameters (a reference copy, an objective's
    reward model or teacher: bigtrain.train.reference): their weights in the training precision, no gradients or
    optimizer states; partitioned like the policy's under ZeRO-3 (on the host where the policy's parameters are
    offloaded), whole on each rank below. The policy's own adapters off (adapters_off) or none: nothing."""
    if not num_params:
        return 0.0, 0.0
    p = PRECISIONS[setup.precision]
    if setup.zero_stage < 3:
        return p * num_params, 0.0
    share = p * num_params / setup.zero_ranks
    if setup.offload_param == "cpu":
        return p * persistent, share
    return share + p * persistent, 0.0


def split_activations(count: ActivationCount, setup: Setup) -> ActivationCount:
    """One rank's share of a sample's activations under tensor and sequence parallelism (see the module doc)."""
    block_share = (10 + 24 / setup.tensor) / 34  # Korthikanti: 10sbh replicated, 24sbh split per layer
    u = setup.sequence
    def share(value: float | None) -> float | None:
        return None if value is None else value / u

    return ActivationCount(outside=count.outside / u, blocks=count.blocks * block_share / u,
                           largest_block=count.largest_block * block_share / u, block_inputs=count.block_inputs / u,
                           transient=count.transient / u, transient_checkpointed=share(count.transient_checkpointed),
                           transient_after=share(count.transient_after),
                           transient_checkpointed_after=share(count.transient_checkpointed_after))
