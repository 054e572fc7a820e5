"""Which keys a DeepSpeed config may hold, at every level.

DeepSpeed ignores unknown top-level keys and dict-style sections, so a typo silently drops a
setting. Sections that DeepSpeed models with pydantic are read from those models; the rest
are listed here from DeepSpeed's config reference and source (0.19).
"""
from __future__ import annotations

import inspect
from typing import Any

TOP_LEVEL = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
    "scheduler", "communication_data_type", "seq_parallel_communication_data_type", "prescale_gradients",
    "gradient_predivide_factor", "sparse_gradients", "gradient_clipping", "gradient_allreduce_op", "fp16", "bf16",
    "bfloat16", "amp", "torch_autocast", "zero_optimization", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "aio", "activation_checkpointing", "steps_per_print", "wall_clock_breakdown",
    "dump_state", "flops_profiler", "comms_logger", "tensorboard", "csv_monitor", "wandb", "comet", "monitor_config",
    "elasticity", "pipeline", "sparse_attention", "data_efficiency", "curriculum_learning", "checkpoint",
    "data_types", "dataloader_drop_last", "memory_breakdown", "compression_training", "autotuning", "nebula",
    "weight_quantization", "hybrid_engine", "tensor_parallel", "compile", "timers", "disable_allgather",
    "log_level", "managed_gradient_accumulation", "disable_python_gc", "expert_parallel", "quantize_training",
    "progressive_layer_drop", "eigenvalue", "use_data_before_expert_parallelism", "vocabulary_size",
    "graph_harvesting", "zenflow", "optimizer_gradient_clipping",
}

# Dict-style sections DeepSpeed reads key by key (no pydantic model to ask).
DICT_SECTIONS: dict[str, set[str]] = {
    "optimizer": {"type", "params", "legacy_fusion"},
    "scheduler": {"type", "params"},
    "activation_checkpointing": {"partition_activations", "number_checkpoints", "contiguous_memory_optimization",
                                 "synchronize_checkpoint_boundary", "profile", "cpu_checkpointing"},
    "pipeline": {"stages", "partition", "seed_layers", "activation_checkpoint_interval", "pipe_partitioned",
                 "grad_partitioned", "use_reentrant"},
    "aio": {"block_size", "queue_depth", "intra_op_parallelism", "thread_count", "single_submit", "overlap_events",
            "use_gds"},
    "flops_profiler": {"enabled", "recompute_fwd_factor", "profile_step", "module_depth", "top_modules", "detailed",
                       "output_file"},
    "checkpoint": {"tag_validation", "load_universal", "use_node_local_storage", "parallel_write"},
    "data_types": {"grad_accum_dtype", "param_dtype"},
}

# DeepSpeed's own extra Adam parameters, popped before the torch/fused optimizer sees them.
ADAM_EXTRA = {"torch_adam", "adam_w_mode", "fp32_optimizer_states", "foreach", "bias_correction", "set_grad_none"}


def pydantic_sections() -> dict[str, Any]:
    """Section name -> DeepSpeed's pydantic model for it (these forbid unknown keys)."""
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    return {"zero_optimization": DeepSpeedZeroConfig, "bf16": DeepSpeedBF16Config, "bfloat16": DeepSpeedBF16Config,
            "fp16": DeepSpeedFP16Config, "tensorboard": TensorBoardConfig, "csv_monitor": CSVConfig,
            "wandb": WandbConfig, "comet": CometConfig, "comms_logger": CommsLoggerConfig}


def model_keys(model: Any) -> dict[str, Any]:
    """Accepted keys of a pydantic model (names and aliases) -> the nested model, or None for a leaf."""
    keys: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        nested = _nested_model(info.annotation)
        keys[name] = nested
        if info.alias:
            keys[info.alias] = nested
    return keys


def _nested_model(annotation: Any) -> Any:
    candidates = [annotation, *getattr(annotation, "__args__", ())]
    for candidate in candidates:
        if inspect.isclass(candidate) and hasattr(candidate, "model_fields"):
            return candidate
    return None


def scheduler_param_keys(type_name: str) -> set[str] | None:
    """Constructor arguments of DeepSpeed's scheduler `type_name`; None for an unknown type."""
    from deepspeed.runtime import lr_schedules
    cls = getattr(lr_schedules, type_name, None)
    if type_name not in lr_schedules.VALID_LR_SCHEDULES or cls is None:
        return None
    return set(inspect.signature(cls.__init__).parameters) - {"self", "optimizer"}


def optimizer_param_keys(type_name: str) -> set[str] | None:
    """Keys DeepSpeed's optimizer `type_name` accepts in `params`; None when we can't tell (custom types)."""
    import torch
    lowered = type_name.lower()
    if lowered in ("adam", "adamw"):
        return set(inspect.signature(torch.optim.AdamW.__init__).parameters) - {"self", "params"} | ADAM_EXTRA
    torch_cls = getattr(torch.optim, type_name, None)
    if torch_cls is not None:
        return set(inspect.signature(torch_cls.__init__).parameters) - {"self", "params"}
    return None
