"""Run config + world size -> the DeepSpeed config dict. Pure: no I/O, no device queries."""
from __future__ import annotations

from bigtrain.config.run_config import (ActivationCheckpointConfig, OffloadConfig, OptimizerConfig, RunConfig,
                                        ScheduleConfig, ZeroConfig)
from bigtrain.ds.batch import BatchTriple, solve_batch
from bigtrain.ds.keys import (BATCH_FIELDS, MUON_FIELDS, OPTIMIZER_TYPES, SCHEDULER_TYPES, ZERO_COMMON,
                              ZERO_PLUS_PLUS, ZERO_STAGE_1_2, ZERO_STAGE_3)
from bigtrain.config.topology import Topology


def build_ds_config(run: RunConfig, world_size: int) -> dict:
    """The DeepSpeed dict for `run` at `world_size` ranks; the batch triple always holds."""
    triple = batch_triple(run, world_size)
    precision = "bf16" if run.precision == "auto" else run.precision  # the runner resolves auto per device
    config = {
        **{BATCH_FIELDS[f"batch.{member}"]: getattr(triple, member)
           for member in ("global_batch", "micro_batch", "grad_accum")},
        "gradient_clipping": run.optimizer.grad_clip,
        "steps_per_print": 1000,
        "optimizer": optimizer_section(run.optimizer),
        "scheduler": scheduler_section(run.schedule, run.optimizer.lr, run.train.steps),
        "bf16": bf16_section(precision == "bf16"),
        "fp16": fp16_section(precision == "fp16"),
        "zero_optimization": zero_section(run.zero, run.offload),
    }
    if run.activation_checkpointing.enabled:  # the section's presence is what switches it on
        config["activation_checkpointing"] = activation_section(run.activation_checkpointing)
    if "nvme" in (run.offload.optimizer, run.offload.param):
        config["aio"] = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
                         "single_submit": False, "overlap_events": True}
    if run.optimizer.name in ("sgd", "lamb") and run.zero.stage >= 1:  # not on DeepSpeed's ZeRO-tested list
        config["zero_allow_untested_optimizer"] = True
    if run.optimizer.name == "muon" and run.zero.stage == 3:  # DeepSpeed's ZeRO-3 refuses Muon with reduce_scatter
        config["zero_optimization"]["reduce_scatter"] = False
    if run.parallel.tensor > 1:  # DeepSpeed's AutoTP splits the layers inside deepspeed.initialize
        config["tensor_parallel"] = {"autotp_size": run.parallel.tensor}
    if run.parallel.sequence > 1:  # Ulysses: the engine gets its process groups (bigtrain.parallel.split)
        config["sequence_parallel_size"] = run.parallel.sequence
    if run.parallel.expert > 1:  # AutoEP: DeepSpeed's engine swaps the MoE blocks (bigtrain.parallel.experts)
        config["expert_parallel"] = {"enabled": True, "autoep_size": run.parallel.expert}
    if run.pipeline.stages > 1:
        config["pipeline"] = {
            "stages": run.pipeline.stages,
            "partition": run.pipeline.partition_method,
            "activation_checkpoint_interval":
                run.activation_checkpointing.every_n_layers if run.activation_checkpointing.enabled else 0,
        }
    return config


def batch_triple(run: RunConfig, world_size: int) -> BatchTriple:
    dp = Topology.of_run(run.parallel, run.pipeline.stages, world_size).check().data
    micro = None if run.batch.micro_batch == "auto" else run.batch.micro_batch  # the job probes it (train.autobatch)
    return solve_batch(run.batch.global_batch, micro, run.batch.grad_accum, dp)


def optimizer_section(opt: OptimizerConfig) -> dict:
    params: dict = {"lr": opt.lr, "weight_decay": opt.weight_decay}
    if opt.name != "sgd":
        params.update(betas=list(opt.betas), eps=opt.eps)
    if opt.name == "muon":  # DeepSpeed's Muon: lr/betas/eps are its Adam half's
        params.update({key: getattr(opt, field.split(".")[1]) for field, key in MUON_FIELDS.items()})
    if opt.torch_adam is not None and opt.name in ("adam", "adamw", "muon"):
        params["torch_adam"] = opt.torch_adam
    return {"type": OPTIMIZER_TYPES[opt.name], "params": params}


def scheduler_section(schedule: ScheduleConfig, lr: float, total_steps: int) -> dict:
    """Warm-up from min_lr_ratio * lr to lr, then cosine / linear decay to min_lr_ratio * lr, or constant.
    warmup_steps=0 (no warm-up): DeepSpeed's schedulers take 1 step at least (run over 2), so that step starts at
    the peak instead (WarmupCosineLR's warmup_min_ratio 1.0, WarmupLR's min = max): the rate is the peak from the
    first step, and a cosine decay runs from the third (the linear schedule cannot: the run config refuses it)."""
    warmup = min(schedule.warmup_steps, total_steps)
    start = 1.0 if warmup == 0 else schedule.min_lr_ratio  # the warm-up's first rate, a fraction of the peak
    warmup = max(warmup, 1)
    ds_type = SCHEDULER_TYPES[schedule.kind]
    if schedule.kind == "cosine":
        return {"type": ds_type, "params": {
            "total_num_steps": total_steps, "warmup_num_steps": warmup, "warmup_type": "linear",
            "warmup_min_ratio": start, "cos_min_ratio": schedule.min_lr_ratio}}
    assert start < 1.0 or schedule.kind == "constant", schedule  # WarmupDecayLR decays to its warm-up's start
    # WarmupDecayLR / WarmupLR take absolute rates, not ratios of the optimizer's lr.
    params = {"warmup_min_lr": lr * start, "warmup_max_lr": lr, "warmup_num_steps": warmup, "warmup_type": "linear"}
    if schedule.kind == "linear":
        return {"type": ds_type, "params": {**params, "total_num_steps": total_steps}}
    return {"type": ds_type, "params": params}


def bf16_section(enabled: bool) -> dict:
    """bf16 has fp32's exponent range, so its gradients do not overflow the way fp16's do: no overflow check.
    DeepSpeed 0.19.8 checks by default (`check_grad_overflow`), with per-parameter isfinite/abs/amax kernels
    and host syncs every step: the host-bound `step` phase of the H100 profile (docs/benchmarks.md)."""
    return {"enabled": True, "check_grad_overflow": False} if enabled else {"enabled": False}


def fp16_section(enabled: bool) -> dict:
    if not enabled:
        return {"enabled": False}
    return {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
            "hysteresis": 2, "min_loss_scale": 1}


def zero_section(zero: ZeroConfig, offload: OffloadConfig) -> dict:
    section: dict = {"stage": zero.stage}
    if zero.stage == 0:
        return section
    for field, key in {**ZERO_COMMON, **(ZERO_STAGE_3 if zero.stage == 3 else ZERO_STAGE_1_2)}.items():
        section[key] = getattr(zero, field.removeprefix("zero."))
    if zero.stage == 3:  # ZeRO++: only what is set
        section.update({ZERO_PLUS_PLUS[field]: value for field, value in zero.plus_plus().items()})
    if offload.optimizer != "none":
        section["offload_optimizer"] = _offload(offload.optimizer, offload, buffer_count=4)
    if offload.param != "none":
        section["offload_param"] = _offload(offload.param, offload, buffer_count=5)
    return section


def _offload(device: str, offload: OffloadConfig, buffer_count: int) -> dict:
    section: dict = {"device": device, "pin_memory": offload.pin_memory}
    if device == "nvme":
        section.update(nvme_path=offload.nvme_path, buffer_count=buffer_count)
    return section


def activation_section(ac: ActivationCheckpointConfig) -> dict:
    """DeepSpeed's activation-checkpointing settings; whether blocks are checkpointed is bigtrain's call."""
    return {"partition_activations": ac.partition_activations, "cpu_checkpointing": ac.cpu_checkpointing,
            "contiguous_memory_optimization": False, "synchronize_checkpoint_boundary": False}


def monitor_sections(out_dir: str, job_name: str, tensorboard: bool, csv: bool) -> dict:
    """DeepSpeed monitor sections writing under `out_dir` (added by the runner, not in the checked-in files)."""
    sections = {}
    if tensorboard:
        sections["tensorboard"] = {"enabled": True, "output_path": f"{out_dir}/tensorboard", "job_name": job_name}
    if csv:
        sections["csv_monitor"] = {"enabled": True, "output_path": f"{out_dir}/csv", "job_name": job_name}
    return sections
