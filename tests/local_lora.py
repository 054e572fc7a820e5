"""Base models for the LoRA tests of both tiers (tests/unit/test_lora.py, tests/dist/test_lora_training.py): a tiny
Llama and a tiny GPT-2 saved as local Hugging Face directories (random weights, a BPE trained on Python's own docs,
no download), and a text corpus to fine-tune them on."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 320


def make_base_dirs(root: Path) -> dict[str, Path]:
    """{"llama": dir, "gpt2": dir, "corpus": file}; the same weights every time (seeded). No dropout: one process
    and several ranks draw other masks, and the tests compare their losses."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from bigtrain.data.builtin import builtin_documents
    from bigtrain.data.tokenizer import train_bpe

    root.mkdir(parents=True, exist_ok=True)
    docs = builtin_documents()
    (root / "corpus.txt").write_text("".join(docs[:16]))
    tok = train_bpe(docs[:40], VOCAB)
    vocab = len(tok)
    models = {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)),
        "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                                   bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    }
    dirs = {"corpus": root / "corpus.txt"}
    for i, (name, make) in enumerate(models.items()):
        torch.manual_seed(10 + i)
        make().save_pretrained(root / name)
        tok.save_pretrained(root / name)
        dirs[name] = root / name
    return dirs


def make_chat_base(root: Path, own_pad: bool = False) -> dict[str, Path]:
    """{"chat_llama": dir, "chats": file}: the tiny Llama with a Llama-3-style chat template (tests/local_chat.py;
    `own_pad`: its pad apart from its end-of-text) and a jsonl of conversations, as the README's fine-tuning
    walk-through has them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from local_chat import conversations, make_chat_tokenizer, write_jsonl
    tok = make_chat_tokenizer(root / "chat_llama", own_pad=own_pad)
    torch.manual_seed(12)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                 tie_word_embeddings=False)).save_pretrained(root / "chat_llama")
    return {"chat_llama": root / "chat_llama", "chats": write_jsonl(root / "chats.jsonl", conversations(400))}


def base_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The directory's saved tensors by name (one safetensors file)."""
    from safetensors.torch import load_file
    return load_file(str(directory / "model.safetensors"))
