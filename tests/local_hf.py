"""Local Hugging Face directories made here, for the `--model hf` tests of both tiers
(tests/unit/test_hf_models.py, tests/dist/test_hf_models_training.py): Llama, Qwen2 and Mistral decoders and
a BERT classifier, each a config with random weights and a tokenizer trained on Python's own docs, plus a
config-only Llama, a ViT, a remote-code config, and two architectures whose transformers classes have no
sdpa attention (Gemma2, DeBERTa-v2)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

DECODERS = ("llama", "qwen2", "mistral")
SEQ = 32


def decoder_config(arch: str, vocab: int):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    shape = dict(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    if arch == "llama":
        return LlamaConfig(**shape, tie_word_embeddings=False)
    if arch == "qwen2":  # biased q/k/v projections, tied embeddings
        return Qwen2Config(**shape, tie_word_embeddings=True)
    return MistralConfig(**shape, sliding_window=16)  # shorter than SEQ: the sliding mask matters


def make_hf_dirs(root: Path) -> dict[str, Path]:
    """{name: directory}: the three decoders (+ a config-only llama), a BERT classifier, a ViT, the data."""
    from transformers import (AutoModelForCausalLM, BertConfig, BertForSequenceClassification, BertTokenizerFast,
                              ViTConfig)

    from bigtrain.data.builtin import builtin_classification, builtin_documents
    from bigtrain.data.tokenizer import train_bpe

    docs = builtin_documents()
    (root / "corpus.txt").write_text("".join(docs[:16]))
    tok = train_bpe(docs[:40], 320)
    dirs = {"corpus": root / "corpus.txt"}
    for i, arch in enumerate(DECODERS):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(decoder_config(arch, len(tok)))
        model.save_pretrained(root / arch)
        tok.save_pretrained(root / arch)
        dirs[arch] = root / arch
    decoder_config("llama", len(tok)).save_pretrained(root / "config_only")
    dirs["config_only"] = root / "config_only"

    texts, labels, _ = builtin_classification(2)
    with (root / "labels.jsonl").open("w") as f:
        for text, label in zip(texts, labels):
            f.write(json.dumps({"text": text[:300], "label": label}) + "\n")
    from tokenizers import BertWordPieceTokenizer
    wordpiece = BertWordPieceTokenizer(lowercase=True)
    wordpiece.train_from_iterator(texts, vocab_size=600, min_frequency=2)
    wordpiece.save_model(str(root))
    bert_tok = BertTokenizerFast(vocab_file=str(root / "vocab.txt"))
    # A 3-way head saved: the 2-label data gives a 2-way head, which starts fresh.
    bert = BertForSequenceClassification(BertConfig(vocab_size=len(bert_tok), hidden_size=64, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=128,
                                                    max_position_embeddings=64, num_labels=3))
    bert.save_pretrained(root / "bert")
    bert_tok.save_pretrained(root / "bert")
    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(root / "vit")
    (root / "remote").mkdir()
    (root / "remote" / "config.json").write_text(json.dumps(
        {"model_type": "mymodel", "auto_map": {"AutoConfig": "modeling_mymodel.MyConfig"}}))
    dirs.update(labels=root / "labels.jsonl", bert=root / "bert", vit=root / "vit", remote=root / "remote")
    dirs.update(held_out_dirs(root, tok))
    return dirs


def held_out_dirs(root: Path, tok) -> dict[str, Path]:
    """Gemma2 (logit soft-capping: transformers gives it no sdpa) and a DeBERTa-v2 classifier (disentangled
    attention, no sdpa either), saved with random weights and the BPE trained above."""
    from transformers import (DebertaV2Config, DebertaV2ForSequenceClassification, Gemma2Config,
                              Gemma2ForCausalLM)

    torch.manual_seed(5)
    gemma = Gemma2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                         sliding_window=16, pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id,
                         eos_token_id=tok.eos_token_id)
    deberta = DebertaV2Config(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=128, max_position_embeddings=64, num_labels=2,
                              pad_token_id=tok.pad_token_id)
    made = {"gemma2": Gemma2ForCausalLM._from_config(gemma, attn_implementation="eager"),
            "deberta_v2": DebertaV2ForSequenceClassification._from_config(deberta, attn_implementation="eager")}
    for name, model in made.items():
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return {name: root / name for name in made}
