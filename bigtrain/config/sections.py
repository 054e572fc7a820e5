"""The run config's sections, one dataclass each, every field documented in its `doc` metadata
(`bigtrain.config.run_config.RunConfig` holds them and checks how they combine)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from bigtrain.fields import doc
from bigtrain.models.names import canonical, default_size
from bigtrain.config.rules import partition_problem, zero_plus_plus_problem
from bigtrain.objectives import OBJECTIVES

OffloadDevice = Literal["none", "cpu", "nvme"]


def _fine_tuning_rates() -> str:
    """Each objective's fine-tuning rate (`Objective.fine_tuning`), kinds of one rate together: for optimizer.lr's
    help."""
    rates: dict[float, list[str]] = {}
    for kind, cls in OBJECTIVES.items():
        if cls.fine_tuning is not None:
            rates.setdefault(cls.fine_tuning.lr, []).append(kind)
    return ", ".join(f"{'/'.join(kinds)} {lr:g}" for lr, kinds in rates.items())


@dataclass
class ModelConfig:
    family: Literal["gpt2", "llama", "hf", "vlm", "encoder", "transformer", "resnet"] = doc(
        "gpt2", "Model family; 'hf' is any Hugging Face model (model.pretrained), 'vlm' a vision-language one (its "
        "processor beside it), 'transformer' = encoder.")
    size: str | None = doc(None, "Named size (see `bigtrain models`); 'custom' takes its shape from overrides. "
                           "Default: mini, or the shape of the model.pretrained directory.")
    overrides: dict = doc(dict, "Family config overrides, e.g. {n_layer: 4, n_embd: 256}.")
    pretrained: str | None = doc(None, "Hugging Face model to start from (gpt2, llama, hf): a local directory "
                                 "(config.json [+ weights, tokenizer]) or a Hub name (org/name, downloaded once per "
                                 "node into the Hugging Face cache); its tokenizer is the default data.tokenizer.")
    revision: str | None = doc(None, "Branch, tag or commit of a Hub model.pretrained (default main); the commit it "
                               "named is kept in summary.json and every checkpoint, and --resume and export use it.")

    def __post_init__(self) -> None:
        self.family = canonical(self.family)  # "transformer" is the encoder classifier
        if self.size is None:
            self.size = default_size(self.family, self.pretrained)
        if self.revision is not None and not self.pretrained:
            raise ValueError(f"model.revision={self.revision!r} picks a version of a Hub model.pretrained, and "
                             "model.pretrained is not set; give --set model.pretrained=ORG/NAME or drop model.revision")


@dataclass
class DataConfig:
    source: str = doc("builtin", "'builtin', 'synthetic', a file/dir/glob (txt/jsonl/parquet, image folder), 'hf:NAME', "
                      "a `bigtrain prepare` output, or a mixture 'a/:0.7,b/:0.3'.")
    tokenizer: str | None = doc(None, "Tokenizer dir or hub name; None trains a byte-level BPE on the corpus.")
    vocab_size: int = doc(4096, "Vocabulary size of the BPE trained when no tokenizer is given.")
    seq_len: int = doc(256, "Tokens per sample; packed text blocks hold seq_len + 1 (the last one a target).")
    val_fraction: float = doc(0.05, "Share of the data held out for validation.")
    text_field: str = doc("text", "Text column of jsonl/parquet data.")
    label_field: str = doc("label", "Label column for classification data.")
    image_size: int = doc(32, "Side of the square images fed to ResNet.")
    num_classes: int | None = doc(None, "Classes for classification models; None: as many as the labels "
                                  "need (10 for synthetic and builtin data).")
    synthetic_samples: int = doc(4096, "Samples in the synthetic dataset.")
    split: str = doc("train", "Split of an hf: source.")
    revision: str | None = doc(None, "Revision (branch, tag, commit) of an hf: source; pin it for reproducible data.")
    streaming: bool = doc(False, "Stream an hf: source through prepare instead of downloading it first.")
    hash_content: bool = doc(False, "Identify local data by content (reads every byte), not names, sizes, mtimes.")
    num_proc: int | None = doc(None, "Processes that tokenize an unprepared text source; None: every core.")
    format: Literal["auto", "text", "chat", "sharegpt", "prompt_completion", "alpaca", "preference",
                    "preference_instruction", "prompt"] = doc(
        "auto", "Records: chat ('messages' of role/content, rendered by the chat template), sharegpt "
        "('conversations' of from/value, rendered so too), prompt_completion, "
        "alpaca (instruction/input/output), preference pairs (prompt/chosen/rejected, strings or messages; "
        "preference_instruction: instruction/input/chosen/rejected) or text; auto recognises them from the first "
        "record. prompt: prompts alone, every other column kept (online RL; auto reads them so when the "
        "objective generates).")
    chat_template: str | None = doc(None, "Jinja chat template (a file, or the text) for chat records; None: the "
                                    "tokenizer's own.")
    train_on_prompt: bool = doc(False, "Chat/instruction data: train on every token, not only the answers.")
    long_examples: Literal["truncate", "drop"] = doc(
        "truncate", "Chat/instruction examples longer than seq_len: keep their first seq_len tokens, or drop them.")
    packing: bool = doc(False, "Chat/instruction data: several examples per sequence, attention kept within each "
                        "(position ids restart per example).")
    padding: Literal["auto", "longest", "max_length"] = doc(
        "auto", "Chat, instruction and preference rows: each micro-batch cut after the last token any of its rows "
        "trains on (longest: TRL's collators pad to the batch's longest row; the loss is the same), or every row "
        "data.seq_len long (max_length: fixed shapes); auto = longest, max_length under pipeline stages or sequence "
        "parallelism, which need fixed shapes.")

    def __post_init__(self) -> None:
        from bigtrain.data.formats import ExampleOptions
        ExampleOptions(self.format, self.chat_template, self.train_on_prompt, self.long_examples, self.packing)
        positive(self, "data", "seq_len", "vocab_size", "image_size", "synthetic_samples")
        if self.num_proc is not None:
            positive(self, "data", "num_proc")
        if self.num_classes is not None:
            positive(self, "data", "num_classes")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction={self.val_fraction}: must be in (0, 1), e.g. 0.05")


@dataclass
class OptimizerConfig:
    name: Literal["adamw", "adam", "sgd", "lamb", "muon"] = doc(
        "adamw", "Optimizer; Lamb needs a GPU (the 1-bit optimizers are not in DeepSpeed 0.19); muon = DeepSpeed's "
        "Muon: the 2-D hidden weights by Muon (optimizer.muon_lr, optimizer.momentum), embeddings, head, norms and "
        "biases by Adam (optimizer.lr, betas, eps); ZeRO 0-3.")
    lr: float | None = doc(None, "Peak learning rate (with muon: the Adam half's). Unset: chosen by what the run is "
                           "(bigtrain.config.defaults, docs/fine-tuning.md): 6e-4 from random weights; from "
                           f"model.pretrained the objective's fine-tuning rate, TRL's ({_fine_tuning_rates()}), "
                           "10 x with LoRA.")
    muon_lr: float = doc(0.02, "optimizer.name=muon: peak learning rate of the weights Muon trains (the schedule "
                         "scales it like optimizer.lr).")
    momentum: float = doc(0.95, "optimizer.name=muon: Muon's momentum.")
    betas: tuple[float, float] | None = doc(None, "Adam's betas. Unset: chosen by what the run is "
                                            "(bigtrain.config.defaults, docs/fine-tuning.md): (0.9, 0.95) from random "
                                            "weights; (0.9, 0.999) from model.pretrained (TRL's and the HF "
                                            "Trainer's).")
    eps: float = doc(1e-8, "Adam epsilon.")
    weight_decay: float | None = doc(None, "Decoupled weight decay (AdamW). Unset: 0.1 from random weights, 0 from "
                                     "model.pretrained (TRL's).")
    grad_clip: float = doc(1.0, "Clip the global gradient norm to this (0 disables).")
    torch_adam: bool | None = doc(None, "Use torch's Adam instead of DeepSpeed's fused/CPU kernel; None = auto.")

    def __post_init__(self) -> None:
        positive(self, "optimizer", "eps", "muon_lr", *(["lr"] if self.lr is not None else []))
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"optimizer.momentum={self.momentum}: must be in [0, 1), e.g. 0.95")
        if self.grad_clip < 0 or (self.weight_decay or 0.0) < 0:
            raise ValueError("optimizer.grad_clip and optimizer.weight_decay must be >= 0")
        if self.betas is not None and (len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas)):
            raise ValueError(f"optimizer.betas={self.betas}: give two values in [0, 1), e.g. [0.9, 0.95]")


@dataclass
class ScheduleConfig:
    kind: Literal["cosine", "linear", "constant"] = doc("cosine", "LR decay after warm-up.")
    warmup_steps: int | None = doc(None, "Linear warm-up steps from min_lr_ratio * lr to lr; 0: none, the peak rate "
                                   "from the first step (cosine and constant; DeepSpeed's linear schedule warms up "
                                   "over 1 step at least). Unset: 20 from random weights, 0 from model.pretrained "
                                   "(TRL's; 1 with schedule.kind=linear).")
    min_lr_ratio: float = doc(0.1, "Final (and initial warm-up) LR as a fraction of the peak.")

    def __post_init__(self) -> None:
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ValueError(f"schedule.warmup_steps={self.warmup_steps}: must be >= 0 (0: no warm-up)")
        if self.warmup_steps == 0 and self.kind == "linear":  # WarmupDecayLR starts at its floor, the decay's end
            raise ValueError("schedule.warmup_steps=0 with schedule.kind=linear: DeepSpeed's linear schedule "
                             "(WarmupDecayLR) starts at its floor and warms up over 1 step at least; give "
                             "schedule.warmup_steps >= 1, or schedule.kind=cosine or constant for no warm-up")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"schedule.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")


@dataclass
class BatchConfig:
    """Any two of the three may be given; the third is derived against the real data-parallel size."""

    global_batch: int | None = doc(None, "Samples per optimizer step over all ranks (train_batch_size).")
    micro_batch: Literal["auto"] | int | None = doc(
        None, "Samples per forward pass per rank (default 4); auto = the largest that fits in device memory, "
        "found by a short probe, with the global batch kept by accumulation (needs batch.global_batch).")
    grad_accum: int | None = doc(None, "Micro-batches per optimizer step; the pipeline's micro-batch count.")

    def __post_init__(self) -> None:
        if self.micro_batch == "auto":
            if self.global_batch is None or self.grad_accum is not None:
                raise ValueError("batch.micro_batch=auto keeps the global batch and derives the accumulation: give "
                                 "batch.global_batch (e.g. --set batch.global_batch=64) and leave batch.grad_accum unset")
        for name in ("global_batch", "micro_batch", "grad_accum"):
            value = getattr(self, name)
            if value is not None and value != "auto" and value <= 0:
                raise ValueError(f"batch.{name}={value}: must be a positive integer (or unset to derive it)")


@dataclass
class ZeroConfig:
    stage: int = doc(1, "ZeRO stage 0-3: 1 shards optimizer states, 2 also gradients, 3 also parameters.")
    overlap_comm: bool = doc(True, "Overlap gradient reduction with the backward pass.")
    contiguous_gradients: bool = doc(True, "Copy gradients into a contiguous buffer as they are produced.")
    reduce_bucket_size: int = doc(50_000_000, "Elements reduced at once.")
    allgather_bucket_size: int = doc(50_000_000, "Elements all-gathered at once (stages 1-2).")
    prefetch_bucket_size: int = doc(50_000_000, "Stage 3: parameter elements prefetched ahead of use.")
    param_persistence_threshold: int = doc(100_000, "Stage 3: parameters smaller than this stay unpartitioned.")
    max_live_parameters: int = doc(1_000_000_000, "Stage 3: most parameter elements resident at once.")
    max_reuse_distance: int = doc(1_000_000_000, "Stage 3: a parameter used again within this many elements "
                                  "stays gathered; 0 frees each after use (less memory, more all-gathers).")
    sub_group_size: int = doc(1_000_000_000, "Stage 3: elements per optimizer step group; DeepSpeed's fp32 "
                              "gradient buffer grows with it.")
    hpz_partition_size: int = doc(1, "ZeRO++ hpZ (stage 3): a second copy of the weights partitioned over this "
                                  "many ranks (a node's), so the backward's all-gathers stay within them; divides "
                                  "the world. 1 = off.")
    quantized_weights: bool = doc(False, "ZeRO++ qwZ (stage 3): all-gather the weights in int8 (DeepSpeed's "
                                  "quantizer kernel: a GPU).")
    quantized_gradients: bool = doc(False, "ZeRO++ qgZ (stage 3): reduce the gradients quantized, by all-to-all "
                                    "(DeepSpeed's quantizer kernel: a GPU).")
    quantized_nontrainable_weights: bool = doc(False, "ZeRO++ (stage 3): keep frozen weights (a LoRA base) in int8 "
                                               "(DeepSpeed's quantizer kernel: a GPU).")

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"zero.stage={self.stage}: allowed values are 0, 1, 2, 3")
        positive(self, "zero", "reduce_bucket_size", "allgather_bucket_size", "sub_group_size", "hpz_partition_size")
        for name in ("prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters", "max_reuse_distance"):
            if getattr(self, name) < 0:
                raise ValueError(f"zero.{name}={getattr(self, name)}: must be >= 0")
        problem = zero_plus_plus_problem(self.stage, self.plus_plus())
        if problem:
            raise ValueError(problem)

    def plus_plus(self) -> dict[str, object]:
        """The ZeRO++ fields set away from their defaults (run-config names)."""
        out: dict[str, object] = {"zero.hpz_partition_size": self.hpz_partition_size} \
            if self.hpz_partition_size != 1 else {}
        for name in ("quantized_weights", "quantized_gradients", "quantized_nontrainable_weights"):
            if getattr(self, name) is True:
                out[f"zero.{name}"] = True
        return out


@dataclass
class OffloadConfig:
    optimizer: OffloadDevice = doc("none", "Where optimizer states live: none (device), cpu, nvme.")
    param: OffloadDevice = doc("none", "Where parameters live (ZeRO-3 only): none, cpu, nvme.")
    nvme_path: str = doc("/local_nvme", "Directory on a fast NVMe drive for nvme offload.")
    pin_memory: bool = doc(True, "Pin offloaded CPU memory for faster transfers.")


@dataclass
class ActivationCheckpointConfig:
    enabled: bool = doc(False, "Recompute activations in the backward pass to save memory.")
    every_n_layers: int = doc(1, "Checkpoint every N blocks (pipeline: activation_checkpoint_interval).")
    partition_activations: bool = doc(False, "Shard checkpointed activations across model-parallel ranks.")
    cpu_checkpointing: bool = doc(False, "Move checkpointed activations to CPU (needs partition_activations).")
    tiled_mlp: Literal["auto"] | bool = doc(
        "auto", "ALST's tiled MLP (DeepSpeed's TiledMLP): each MLP computed over tiles of hidden_size tokens and "
        "recomputed tile by tile in backward, so a layer keeps its MLP input only; with it, Llama-style RMSNorms go "
        "lean (keep only their input, no sequence-long fp32 temporary in backward); the same result. auto = on when "
        "a rank's tokens per sample (data.seq_len / parallel.sequence) reach 4 x the hidden size; false = off. "
        "Independent of activation_checkpointing.enabled; plain modules only (no pipeline).")
    offload_hidden_states: Literal["auto"] | bool = doc(
        "auto", "ALST: keep each checkpointed block's input (its hidden states) in host memory until the backward "
        "pass, with DeepSpeed's offloading context manager around transformers' own checkpointing (not "
        "cpu_checkpointing, DeepSpeed's checkpoint's). auto = on when the device's memory is not the host's (a GPU) "
        "and tiled_mlp's rule holds (a rank's tokens per sample >= 4 x hidden size); needs enabled=true.")

    def __post_init__(self) -> None:
        positive(self, "activation_checkpointing", "every_n_layers")
        if self.cpu_checkpointing and not self.partition_activations:
            raise ValueError("activation_checkpointing.cpu_checkpointing needs partition_activations=true")
        for name in ("tiled_mlp", "offload_hidden_states"):
            if getattr(self, name) not in ("auto", True, False):
                raise ValueError(f"activation_checkpointing.{name}={getattr(self, name)!r}: use auto, true or false")
        if self.offload_hidden_states is True and not self.enabled:
            raise ValueError("activation_checkpointing.offload_hidden_states=true keeps the checkpointed hidden states "
                             "in host memory: set activation_checkpointing.enabled=true too")
        if self.offload_hidden_states is True and (self.partition_activations or self.cpu_checkpointing):
            raise ValueError("activation_checkpointing.offload_hidden_states=true checkpoints with transformers' own "
                             "checkpointing, which DeepSpeed's partition_activations / cpu_checkpointing do not "
                             "apply to; set those false, or offload_hidden_states=false")


@dataclass
class PipelineConfig:
    stages: int = doc(1, "Pipeline stages (1 = no pipeline). Micro-batches per step = batch.grad_accum.")
    partition_method: str = doc("parameters", "How layers are split: parameters, uniform or type:REGEX.")

    def __post_init__(self) -> None:
        positive(self, "pipeline", "stages")
        problem = partition_problem(self.partition_method)
        if problem:
            raise ValueError(problem)


@dataclass
class ParallelConfig:
    tensor: int = doc(1, "Tensor-parallel ranks per layer (DeepSpeed AutoTP): each weight split over this many ranks, "
                         "which see the same batch. Llama-family and Hugging Face decoders.")
    sequence: int = doc(1, "Sequence-parallel ranks (DeepSpeed Ulysses / ALST): each sample's sequence split over "
                           "this many ranks; data.seq_len and the attention heads must divide by it. Decoders "
                           "with sdpa attention.")
    expert: int = doc(1, "Expert-parallel ranks (DeepSpeed AutoEP): each mixture-of-experts block keeps 1/N of its "
                         "experts per rank, the dense weights stay data-parallel over every rank; Hugging Face "
                         "models AutoEP has a preset for (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3...), ZeRO 0-3.")

    def __post_init__(self) -> None:
        positive(self, "parallel", "tensor", "sequence", "expert")


@dataclass
class LoraConfig:
    r: int = doc(0, "LoRA rank: 0 trains every weight; N > 0 freezes the base weights and trains rank-N adapters "
                    "(peft) on lora.targets, so only the adapters have gradients and optimizer states. Decoders "
                    "(gpt2, llama, hf causal LMs), ZeRO 0-3 and offload.")
    alpha: float = doc(16.0, "LoRA scale numerator: the adapters' update is scaled by alpha / r.")
    dropout: float = doc(0.0, "Dropout on the adapters' input, in [0, 1).")
    targets: str | list[str] = doc("all-linear", "Layers that get adapters: all-linear (every linear layer of the "
                                   "decoder, not the output head) or a list of module names, e.g. [q_proj, v_proj].")
    vision_tower: bool = doc(False, "Vision-language models (--model vlm): adapters on the vision tower's linear layers "
                                    "too; by default only the language model's get them.")

    def __post_init__(self) -> None:
        if self.r < 0:
            raise ValueError(f"lora.r={self.r}: must be >= 0 (0 trains every weight; e.g. 16 trains adapters)")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha={self.alpha}: must be > 0 (the update is scaled by alpha / r; e.g. 16)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout={self.dropout}: must be in [0, 1), e.g. 0.05")
        if isinstance(self.targets, str) and self.targets != "all-linear":
            self.targets = [t.strip() for t in self.targets.split(",")]  # --set lora.targets=q_proj,v_proj
        if isinstance(self.targets, list) and (not self.targets or not all(self.targets)):
            raise ValueError(f"lora.targets={self.targets}: give all-linear or module names, e.g. [q_proj, v_proj]")


@dataclass
class LoggingConfig:
    interval: int = doc(10, "Log every N steps.")
    tensorboard: bool = doc(False, "Write TensorBoard events to OUT/tensorboard via DeepSpeed's monitor.")
    csv: bool = doc(True, "Write CSV metrics to OUT/csv via DeepSpeed's monitor.")
    progress_bar: bool = doc(True, "Show a rank-0 progress bar on a terminal.")
    wandb: bool = doc(False, "Log to Weights & Biases through DeepSpeed's wandb monitor, with the run config "
                             "(pip install 'bigtrain[wandb]'); offline under OUT/wandb without credentials.")
    comet: bool = doc(False, "Log to Comet through DeepSpeed's comet monitor, with the run config "
                             "(pip install 'bigtrain[comet]'); offline under OUT/comet without COMET_API_KEY.")
    project: str = doc("bigtrain", "Project name for wandb / comet; the run is named after its output directory.")

    def __post_init__(self) -> None:
        positive(self, "logging", "interval")


@dataclass
class CheckpointConfig:
    dir: str | None = doc(None, "Checkpoint directory (default OUT/checkpoints).")
    interval: int = doc(0, "Save every N steps (0: only at the end and on SIGTERM/SIGINT).")
    keep_last: int = doc(2, "Keep the newest N checkpoints.")
    at_end: bool = doc(True, "Save when the run ends (false: benchmarks and throw-away runs, where a 1B model's "
                       "final save writes ~17 GB; a stop by signal or --stop-after still saves).")

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ValueError(f"checkpoint.interval={self.interval}: must be >= 0")
        positive(self, "checkpoint", "keep_last")


@dataclass
class TrainConfig:
    steps: int = doc(200, "Optimizer steps to train.")
    eval_interval: int = doc(50, "Evaluate every N steps (0: only at the end).")
    eval_batches: int = doc(8, "Micro-batches per rank in each evaluation.")
    eval_tasks: str | list[str] | None = doc(None, "lm-evaluation-harness tasks run at every evaluation, e.g. "
                                             "[hellaswag, arc_easy] or a,b; their scores go to the log line, "
                                             "summary.json, the monitors and loss.png (the [eval] extra).")
    eval_limit: float | None = doc(None, "At most N documents per task (a fraction if < 1) at each evaluation "
                                   "during training; None: all.")
    eval_include_path: str | None = doc(None, "A folder of your own lm-eval task YAML files for train.eval_tasks.")
    seed: int = doc(1234, "Seed for weights, data order and dropout.")
    out_dir: str = doc("runs/latest", "Where checkpoints, logs, exports and summary.json go.")
    peak_tflops: float | None = doc(None, "Per-rank peak TFLOP/s for MFU; None measures it at start.")
    sample_tokens: int = doc(48, "Tokens generated as a sample at the end (GPT-2; 0 disables).")
    max_loss: float | None = doc(None, "Stop the run (exit 3, nothing saved from it) when the training loss "
                                 "exceeds this; a non-finite loss always stops it. None: no bound.")
    compile: Literal["auto", "deepcompile"] | bool = doc(
        "auto", "true, false, auto or deepcompile: torch.compile of the model with its loss (DeepSpeed's "
        "engine.compile); auto = on GPUs at ZeRO 0-2, else off; deepcompile = DeepCompile (CUDA, ZeRO 1-3).")
    loss_impl: Literal["auto", "plain", "chunked"] = doc(
        "auto", "Causal-LM loss: chunked = the output head and cross-entropy chunk by chunk, never a full fp32 "
        "logits tensor (bigtrain.models.chunked_loss); auto = chunked on GPUs, plain on CPUs.")

    def __post_init__(self) -> None:
        positive(self, "train", "steps")
        if self.eval_interval < 0 or self.eval_batches < 0:
            raise ValueError("train.eval_interval and train.eval_batches must be >= 0")
        if self.max_loss is not None and not self.max_loss > 0:
            raise ValueError(f"train.max_loss={self.max_loss}: must be > 0 (or null for no bound)")
        if isinstance(self.eval_tasks, str):  # --set train.eval_tasks=a,b
            self.eval_tasks = [t.strip() for t in self.eval_tasks.split(",") if t.strip()] or None
        if self.eval_limit is not None and not self.eval_limit > 0:
            raise ValueError(f"train.eval_limit={self.eval_limit}: must be > 0 (documents, or a fraction < 1)")


def positive(section: object, name: str, *fields_: str) -> None:
    """Each of `fields_` of the `name` section must be > 0 (one line naming the key if not)."""
    for key in fields_:
        value = getattr(section, key)
        if value is None or value <= 0:
            raise ValueError(f"{name}.{key}={value}: must be > 0")
