"""What one sample's activations hold for backward, and the model facts the memory model reads
(`bigtrain.estimate.memory_model` adds the model states and a setup's splits).

Transformer layers follow Korthikanti et al. 2022: per layer and sample s*h*(c_h*e + m_h) + a*s^2*(c_s*e + m_s)
bytes (e: bytes per value, masks 1 byte); bigtrain's own layers' coefficients were counted from the tensors they
save for backward. Other models' counts are measured (`bigtrain.estimate.counting.measure_activations`): what a
forward saves for backward, and the peak of a whole forward and backward of one sample counted tensor by tensor
(`bigtrain.estimate.live_bytes`, the accounting scripts/profile_alst.py measures real training steps with).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class LayerProfile:
    """Values one transformer layer saves for backward, per sample.

    hidden: per token x hidden unit; scores: per head x token^2 (0 with flash/sdpa kernels);
    the *_masks terms are 1-byte dropout masks, counted only when dropout > 0.
    """

    hidden: float
    scores: float = 0.0
    hidden_masks: float = 0.0
    score_masks: float = 0.0


PROFILES = {
    "korthikanti": LayerProfile(16, 2, 2, 1),  # Megatron GPT layer, materialized attention
    "korthikanti-flash": LayerProfile(16, 0, 2, 0),  # the same with a flash-attention kernel
    # bigtrain's models (dropout 0), counted from saved tensors on CPU with torch 2.13 /
    # transformers 5.23: the fused tanh GELU saves only its 4h input, HF GPT-2 copies q/k/v
    # and the attention output (eager attention also keeps the softmax).
    "gpt2-sdpa": LayerProfile(16, 0, 2, 1),
    "gpt2-eager": LayerProfile(16, 1, 2, 1),
    "encoder-sdpa": LayerProfile(16, 0, 2, 1),
}


@dataclass(frozen=True)
class ActivationCount:
    """Bytes saved for backward for ONE sample, split so that checkpointing can be modelled."""

    outside: float  # outside the repeated blocks: embeddings, final norm, head, loss
    blocks: float  # inside all blocks together
    largest_block: float  # the block recomputed at a time under full checkpointing
    block_inputs: float  # what full checkpointing keeps: each block's input
    # what the peak of the backward holds beyond the saved terms (e.g. the loss gradient over the vocabulary, a
    # block's gradients), without and with checkpointing; measured counts may be negative: a peak that comes after
    # the backward has freed some of what the forward saved
    transient: float = 0.0
    transient_checkpointed: float | None = None  # None: as without checkpointing
    # the same from the first parameter gradient on, when ZeRO 1-2's gradient bucket exists beside them (counted
    # models only; None: not known apart, the peak above stands for the whole backward)
    transient_after: float | None = None
    transient_checkpointed_after: float | None = None

    def total(self, micro_batch: int, checkpointing: bool) -> float:
        """Peak activation bytes of one rank for `micro_batch` samples."""
        return self._with(micro_batch, checkpointing, self.transient, self.transient_checkpointed)

    def total_after_first_gradient(self, micro_batch: int, checkpointing: bool) -> float | None:
        """Peak activation bytes of one rank from the first parameter gradient on; None where not counted apart."""
        if self.transient_after is None:
            return None
        return self._with(micro_batch, checkpointing, self.transient_after, self.transient_checkpointed_after)

    def _with(self, micro_batch: int, checkpointing: bool, transient: float, transient_checkpointed: float | None
              ) -> float:
        kept = self.block_inputs + self.largest_block if checkpointing else self.blocks
        extra = transient if not checkpointing or transient_checkpointed is None else transient_checkpointed
        return micro_batch * (self.outside + kept + extra)


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs to know about a model."""

    family: str
    num_params: int
    n_layer: int = 0
    hidden: int = 0
    heads: int = 0
    seq_len: int = 0
    vocab: int = 0  # > 0 when the loss is over a vocabulary at every position (a language model)
    largest_layer_params: int = 0  # largest module's own parameters (ZeRO-3 gathers module by module)
    param_numels: tuple[int, ...] = ()  # every parameter tensor's size (ZeRO-3 persistence); may be empty
    profile: str = "korthikanti"  # LayerProfile name for transformer activations
    dropout: float = 0.0
    # (bytes/value, tiled MLP, chunked loss) -> count, when measured (`measured_key`)
    measured: dict[tuple[int, bool, bool], ActivationCount] = field(default_factory=dict)
    linear_dims: tuple[tuple[int, int], ...] = ()  # (in, out) of each linear layer LoRA adapts (not the head)
    tensor_whole_params: int = 0  # parameters tensor parallelism keeps whole on every rank (embeddings, norms)
    # ALST's tiled MLP: bytes per sample that each of `mlp_layers` MLPs no longer keeps for backward (bytes/value ->
    # bytes), counted on the meta device with and without the tiling (bigtrain.estimate.shape)
    tiled_mlp_saving: dict[int, float] = field(default_factory=dict)
    mlp_layers: int = 0
    expert_params: int = 0  # parameters of a mixture of experts' experts (what expert parallelism spreads)
    muon_params: int = 0  # parameters DeepSpeed's Muon would train (the rest: its Adam half)
    context: int = 0  # tokens per row the model is built for (data.seq_len), whatever the activations' form
    kv_per_token: int = 0  # values a decoder's KV cache keeps per token of a row: layers x 2 x kv_heads x head_dim

    def persistent_params(self, threshold: int, lora_r: int = 0) -> int:
        """Elements ZeRO-3 keeps whole on every rank: tensors of at most `threshold` elements (adapters included)."""
        return sum(n for n in (*self.param_numels, *self.adapter_numels(lora_r)) if n <= threshold)

    def adapter_numels(self, lora_r: int) -> tuple[int, ...]:
        """LoRA's tensors at rank `lora_r`: A (r x in) and B (out x r) for each adapted layer."""
        return tuple(n for i, o in self.linear_dims for n in (lora_r * i, o * lora_r)) if lora_r else ()


def transformer_activations(shape: ModelShape, bytes_per_value: int, chunked_loss: bool = False) -> ActivationCount:
    """Korthikanti-style activation bytes for one sample of a transformer `shape`; with `chunked_loss` (the loss over
    chunks of the logits, bigtrain.models.chunked_loss) no logits per sample, but the gradient of the head's input
    it computes in forward (the rest it holds once per micro-batch: `chunked_loss_bytes`)."""
    if shape.profile not in PROFILES:
        raise ValueError(f"unknown activation profile {shape.profile!r}; use one of {', '.join(PROFILES)}")
    p, e = PROFILES[shape.profile], bytes_per_value
    s, h, a = shape.seq_len, shape.hidden, shape.heads
    assert s > 0 and h > 0 and a > 0, f"transformer shape needs seq_len, hidden, heads: {shape}"
    masks = 1 if shape.dropout > 0 else 0
    layer = s * h * (p.hidden * e + masks * p.hidden_masks) + a * s * s * (p.scores * e + masks * p.score_masks)
    outside = 2 * s * h * e  # final norm input and head input (pooler input for a classifier)
    transient = 0.0
    if shape.vocab and chunked_loss:
        outside += s * h * e  # d loss / d hidden, made in forward and kept for backward
    elif shape.vocab:
        outside += s * shape.vocab * 4  # the loss keeps fp32 log-probabilities over the vocabulary
        transient = s * shape.vocab * 8  # their gradient and the logits' gradient, both fp32, at backward start
    return ActivationCount(outside=outside, blocks=shape.n_layer * layer, largest_block=layer,
                           block_inputs=shape.n_layer * s * h * e, transient=transient)


def measured_key(bytes_per_value: int, tiled_mlp: bool = False, chunked_loss: bool = False) -> tuple[int, bool, bool]:
    """Where `ModelShape.measured` keeps the count of a precision trained with or without each lever."""
    return bytes_per_value, tiled_mlp, chunked_loss


def activations_per_sample(shape: ModelShape, bytes_per_value: int, tiled_mlp: bool = False,
                           chunked_loss: bool = False) -> ActivationCount:
    """The count measured with these levers when the shape carries them (measured shapes carry what their setups
    train with: `bigtrain.estimate.shape.shape_from_spec`); else the transformer formula, with `tiled_mlp` less what
    the MLPs' intermediates held (each block, and the one recomputed at a time)."""
    key = measured_key(bytes_per_value, tiled_mlp, chunked_loss)
    if key in shape.measured:
        return shape.measured[key]
    assert not shape.measured, f"{shape.family}: activations not measured for {key}; measured {sorted(shape.measured)}"
    if shape.n_layer and shape.hidden:
        count = transformer_activations(shape, bytes_per_value, chunked_loss)
    else:
        raise ValueError(f"no activation model for {shape.family}: measure it "
                         "(bigtrain.estimate.counting.measure_activations)")
    saving = shape.tiled_mlp_saving.get(bytes_per_value, 0.0) if tiled_mlp else 0.0
    if not saving or not shape.mlp_layers:
        return count
    return replace(count, blocks=max(0.0, count.blocks - shape.mlp_layers * saving),
                   largest_block=max(0.0, count.largest_block - saving))


def chunked_loss_bytes(shape: ModelShape, bytes_per_value: int, tokens: int) -> float:
    """What the chunked loss holds once per micro-batch of `tokens` tokens (bigtrain.models.chunked_loss): the head
    weight's fp32 gradient, made in forward, and one chunk's fp32 logits beside their gradient in the compute dtype
    (the same tensor in fp32)."""
    from bigtrain.models.chunked_loss import default_chunk_rows
    if not shape.vocab or not shape.hidden:
        return 0.0
    chunk = min(default_chunk_rows(shape.vocab), tokens)
    return 4 * shape.vocab * shape.hidden + chunk * shape.vocab * (4 + (bytes_per_value if bytes_per_value < 4 else 0))


def chunked_loss_margin(shape: ModelShape, tokens: int) -> float:
    """What the one GPU measurement of the chunked loss held beyond its counted terms, kept until a profile says
    where it goes: bigtrain's run of GPT-2 small (bf16, micro-batch 16 x 1024 tokens, ZeRO-1, torch.compile on, one
    H200, docs/benchmarks_gpu.json) peaked at 10.17 GB, 2.98 GB above this model's other terms, while the plain loss
    beside it matched them (16.60 GB measured, 16.52 estimated). Counted as the plain loss's fp32 log-probabilities
    would be (3.30 GB there); on a CPU, eager or compiled, the chunked loss held none of it."""
    return tokens * shape.vocab * 4.0
