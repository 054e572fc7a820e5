"""Chat data and a base model made here, offline, for the benchmarks that train on conversations (`bigtrain bench
--trl`, scripts/bench_packing.py, bench_preference.py, gpu_journeys.py): conversations whose user turns and answers
are spans of Python's reference docs (pydoc_data) of varied length, a byte-level BPE trained on the same text with
Llama 3's special tokens and chat template, preference pairs made from the chats, and a Llama directory with random
weights as another tool would leave it (config, safetensors, tokenizer).
"""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def make_data(root: Path, examples: int = 2000, answer_words: tuple[int, int] = (8, 400),
              vocab_size: int = 4096) -> tuple[Path, Path]:
    """ROOT/chat.jsonl (`examples` conversations: a user turn of 5-40 words, an answer of `answer_words` words,
    log-uniform) and ROOT/tok (the BPE, with the chat template); returns both paths."""
    from bigtrain.data.builtin import builtin_documents
    from bigtrain.data.tokenizer import train_bpe
    words = " ".join(builtin_documents()).split()
    tok = train_bpe(builtin_documents()[:200], vocab_size)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.bos_token = "<|begin_of_text|>"
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(root / "tok"))
    rng = random.Random(0)

    def span(n: int) -> str:
        start = rng.randrange(len(words) - n)
        return " ".join(words[start:start + n])

    low, high = answer_words
    path = root / "chat.jsonl"
    with path.open("w") as f:
        for _ in range(examples):
            answer = int(math.exp(rng.uniform(math.log(low), math.log(high))))
            f.write(json.dumps({"messages": [{"role": "user", "content": span(rng.randint(5, 40))},
                                             {"role": "assistant", "content": span(answer)}]}) + "\n")
    return path, root / "tok"


def make_pairs(chats: Path, out: Path) -> Path:
    """Preference pairs from the chats of make_data: the chosen answer the chat's own, the rejected one another
    chat's."""
    records = [json.loads(line) for line in chats.read_text().splitlines()]
    rng = random.Random(1)
    with out.open("w") as f:
        for record in records:
            other = rng.choice(records)["messages"][-1]["content"]
            prompt, answer = record["messages"][:-1], record["messages"][-1]["content"]
            f.write(json.dumps({"prompt": prompt, "chosen": [{"role": "assistant", "content": answer}],
                                "rejected": [{"role": "assistant", "content": other}]}) + "\n")
    return out


def make_base(root: Path, tok_dir: Path, size: dict) -> Path:
    """ROOT/base-llama: a Llama (`size`: hidden, layers, heads, kv, ffn, seq) with random weights (seed 0) and the
    tokenizer of `tok_dir`, its end-of-text the end of a turn (<|eot_id|>), as Llama 3 Instruct's."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=size["hidden"], num_hidden_layers=size["layers"],
                         num_attention_heads=size["heads"], num_key_value_heads=size["kv"],
                         intermediate_size=size["ffn"], max_position_embeddings=size["seq"],
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.convert_tokens_to_ids("<|eot_id|>"))
    base = root / "base-llama"
    LlamaForCausalLM(config).save_pretrained(str(base))
    tok.save_pretrained(str(base))
    return base
