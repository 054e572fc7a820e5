"""The one table of run-config field <-> DeepSpeed key: `generate` writes the keys from the fields, `mapping`
reads the fields back from the keys, and the lint names them. No other module spells these keys."""
from __future__ import annotations

# run field -> top-level key (the batch triple)
BATCH_FIELDS = {"batch.global_batch": "train_batch_size", "batch.micro_batch": "train_micro_batch_size_per_gpu",
                "batch.grad_accum": "gradient_accumulation_steps"}
BATCH_KEYS = tuple(BATCH_FIELDS.values())

# run field -> key in zero_optimization (DeepSpeed also reads the pydantic field name without "stage3_")
ZERO_COMMON = {"zero.overlap_comm": "overlap_comm", "zero.contiguous_gradients": "contiguous_gradients",
               "zero.reduce_bucket_size": "reduce_bucket_size"}
ZERO_STAGE_1_2 = {"zero.allgather_bucket_size": "allgather_bucket_size"}
ZERO_STAGE_3 = {"zero.prefetch_bucket_size": "stage3_prefetch_bucket_size",
                "zero.param_persistence_threshold": "stage3_param_persistence_threshold",
                "zero.max_live_parameters": "stage3_max_live_parameters",
                "zero.max_reuse_distance": "stage3_max_reuse_distance", "zero.sub_group_size": "sub_group_size"}
# ZeRO++ (stage 3's communication): written only when set, so that the files of a run without it stay as they were
ZERO_PLUS_PLUS = {"zero.hpz_partition_size": "zero_hpz_partition_size",
                  "zero.quantized_weights": "zero_quantized_weights",
                  "zero.quantized_gradients": "zero_quantized_gradients",
                  "zero.quantized_nontrainable_weights": "zero_quantized_nontrainable_weights"}
ZERO_KEYS = {**ZERO_COMMON, **ZERO_STAGE_1_2, **ZERO_STAGE_3, **ZERO_PLUS_PLUS}

# run field -> key path of a parallel size (the pipeline's own section is generated whole)
PARALLEL_KEYS = {"parallel.tensor": ("tensor_parallel", "autotp_size"), "parallel.sequence": ("sequence_parallel_size",),
                 "parallel.expert": ("expert_parallel", "autoep_size")}



# optimizer.name -> DeepSpeed's optimizer type; schedule.kind <-> DeepSpeed's scheduler type
OPTIMIZER_TYPES = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "lamb": "Lamb", "muon": "Muon"}
MUON_FIELDS = {"optimizer.muon_lr": "muon_lr", "optimizer.momentum": "momentum"}  # in optimizer.params
SCHEDULER_TYPES = {"cosine": "WarmupCosineLR", "linear": "WarmupDecayLR", "constant": "WarmupLR"}
SCHEDULE_KINDS = {ds_type: kind for kind, ds_type in SCHEDULER_TYPES.items()}
