"""Mixture-of-experts Hugging Face directories made here (configs with random weights and a tokenizer trained on
Python's own docs): Mixtral, Qwen2-MoE (with a shared expert) and Qwen3-MoE, four experts, two per token."""
from __future__ import annotations

from pathlib import Path

import torch

MOE = ("mixtral", "qwen2_moe", "qwen3_moe")


def make_moe_dirs(root: Path) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    from bigtrain.data.builtin import builtin_documents
    from bigtrain.data.tokenizer import train_bpe

    tok = train_bpe(builtin_documents()[:40], 320)
    shape = dict(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)
    experts = dict(num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=1)
    configs = {"mixtral": MixtralConfig(**shape, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2),
               "qwen2_moe": Qwen2MoeConfig(**shape, intermediate_size=96, num_experts=4,
                                           shared_expert_intermediate_size=64, **experts),
               "qwen3_moe": Qwen3MoeConfig(**shape, intermediate_size=96, num_experts=4, head_dim=16, **experts)}
    dirs = {}
    for i, (name, config) in enumerate(configs.items()):
        torch.manual_seed(i)
        AutoModelForCausalLM.from_config(config).save_pretrained(root / name)
        tok.save_pretrained(root / name)
        dirs[name] = root / name
    return dirs
