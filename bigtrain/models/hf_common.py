"""What the families built on transformers classes (gpt2, llama, hf) share: construction without
a wasted random init, HF's own per-module init rule, the causal-LM loss and batch, activation
checkpointing, and FLOPs from the module and the config.

FLOPs per token for training (Kaplan et al. 2020; PaLM appendix B): 6N + 12 * L * w * s, where
N counts the weights that take part in a matmul (every parameter except embedding lookups that
are not also the output head; norms and biases are in N, a fraction of a percent), L is the
number of layers, w the attention width (query heads x head dim: grouped-query attention
shares keys and values but every query head still scores every position), and s the sequence
length. Causal attention is counted as full, as kernels compute it.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from transformers.initialization import guard_torch_init_functions, no_init_weights

from bigtrain.models.losses import causal_lm_loss


def construct_hf(model_cls: type, config: Any) -> nn.Module:
    """`model_cls(config)` in fp32 with its random init skipped (bigtrain's seeded init follows).

    The class is called directly rather than through `_from_config`: under ZeRO-3 that would open
    its own zero.Init and run a full gathered init on rank 0 only to have it overwritten.
    """
    with no_init_weights():
        model = model_cls(config)
    model.tie_weights()
    model.loss_type = "ForCausalLM" if hasattr(model, "lm_head") else getattr(model, "loss_type", None)
    return model


def hf_init_fn(model_cls: type, config: Any) -> Callable[[nn.Module], None]:
    """The class's own `_init_weights(module)` (it reads only `self.config`), as a per-module init rule."""
    holder = model_cls.__new__(model_cls)
    holder.__dict__["config"] = config

    def init(module: nn.Module) -> None:
        with guard_torch_init_functions():
            holder._init_weights(module)

    return init


def meta_module(model_cls: type, config: Any) -> nn.Module:
    """The module on the meta device: shapes and parameter names, no memory, milliseconds."""
    with torch.device("meta"), no_init_weights():
        model = model_cls(config)
    model.tie_weights()
    return model


def matmul_params(model: nn.Module) -> int:
    """Parameters that take part in a matmul: all, less embedding lookups that are not the output head."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = getattr(output, "weight", None)
    seen: set[int] = set()
    total = 0
    for p in model.parameters():  # unique parameters (tied ones once)
        seen.add(id(p))
        total += p.numel()
    lookups = sum(m.weight.numel() for m in model.modules()
                  if isinstance(m, nn.Embedding) and m.weight is not head)
    return total - lookups


def attention_width(config: Any) -> int:
    """Query heads x head dim, from an HF config (head_dim when the config sets it)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads * head_dim


def flops_per_token(n_matmul: int, n_layer: int, width: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N + 12 * L * w * s (see the module docstring)."""
    return 6.0 * n_matmul + 12.0 * n_layer * width * seq_len


def causal_module_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    return causal_lm_loss(output.logits, labels)


def causal_loss_for(config: Any) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The training loss of a causal LM: next-token loss, plus a mixture of experts' router load-balancing loss
    weighted as its config says (transformers adds it only when it computes the loss itself, from labels)."""
    coef = router_aux_coef(config)
    if coef is None:
        return causal_module_loss

    def with_router_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss(output.logits, labels) + coef * output.aux_loss

    return with_router_loss


def text_batch(family: str) -> Callable[[dict], tuple[Any, torch.Tensor]]:
    def to_inputs(batch: dict) -> tuple[Any, torch.Tensor]:
        """{"input_ids": [B,T], "labels": [B,T] or [B,T+1]} -> (input_ids, labels). A packed batch also has
        "position_ids" restarting at every example: the inputs are then {"input_ids", "position_ids"}, from
        which transformers masks attention to each example's own tokens (`bigtrain.data.examples`)."""
        if "input_ids" not in batch or "labels" not in batch:
            raise ValueError(f"{family} batches need keys 'input_ids' and 'labels'; got {sorted(batch)}")
        if "position_ids" in batch:
            return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}, batch["labels"]
        return batch["input_ids"], batch["labels"]

    return to_inputs


def decoder_blocks(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, index) of each repeated block: the children of the model's longest ModuleList."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        return []
    blocks = max(lists, key=len)
    return [(blocks, str(i)) for i in range(len(blocks))]


def native_checkpointing(model: nn.Module, every_n: int = 1) -> None:
    """transformers' own activation checkpointing (non-reentrant torch checkpoint)."""
    model.activation_checkpointing_enable(every_n_layers=every_n)


DROPOUT_KEYS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "attention_dropout", "resid_pdrop",
                "embd_pdrop", "attn_pdrop", "hidden_dropout", "dropout", "classifier_dropout")


def set_dropout(config: Any, rate: float | None) -> None:
    """Every dropout rate `config` has set to `rate` (model.overrides.dropout; None keeps the directory's)."""
    if rate is None:
        return
    for key in DROPOUT_KEYS:
        if isinstance(getattr(config, key, None), float):
            setattr(config, key, rate)


def set_training_defaults(config: Any, attn_implementation: str) -> None:
    """No KV cache (a recomputed block would append to it twice), the attention kernel chosen, and a mixture
    of experts' router logits on, so that its load-balancing loss is trained and reported."""
    config.use_cache = False
    config._attn_implementation = attn_implementation
    if hasattr(config, "output_router_logits") and hasattr(config, "router_aux_loss_coef"):
        config.output_router_logits = True


def router_aux_coef(config: Any) -> float | None:
    """The weight of a mixture of experts' load-balancing loss in the training loss; None for a dense model."""
    if config is None or not getattr(config, "output_router_logits", False):
        return None
    return float(config.router_aux_loss_coef)


def choose_attention(model_cls: type, requested: str | None) -> tuple[str, str]:
    """(kernel, why) for building `model_cls`: `requested` when given, else torch's sdpa where the class
    supports it, else the architecture's own default, eager (what transformers itself falls back to).

    Decided here, from the class's `_supports_sdpa` flag, rather than left to transformers: the pipeline
    blocks and the log read the kernel from the config, so it must be a name, never None. Asking for sdpa
    where the class has none is a ValueError naming the setting to change, not transformers' request
    to file an issue.
    """
    has_sdpa = bool(getattr(model_cls, "_supports_sdpa", False))
    if requested is None:
        if has_sdpa:
            return "sdpa", "torch's scaled_dot_product_attention, which this architecture supports"
        return "eager", "its own default: transformers gives this architecture no sdpa kernel"
    if requested == "sdpa" and not has_sdpa:
        raise ValueError(f"{model_cls.__name__} has no sdpa attention in transformers; leave "
                         "model.overrides.attn_implementation unset (it then takes the architecture's default, "
                         "eager) or set it to 'eager'")
    return requested, "model.overrides.attn_implementation"
