"""Chat data made in the test: a byte-level BPE (bigtrain's own trainer) given Llama 3's special tokens and a
Llama-3-style chat template, and jsonl files of conversations, prompt/completion pairs and Alpaca records."""
from __future__ import annotations

import json
import random
from pathlib import Path

from bigtrain.data.tokenizer import train_bpe

SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Llama 3's template, less its date and tool lines: a BOS, then each message as header + content + <|eot_id|>.
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# The same, with the assistant's text marked for transformers' return_assistant_tokens_mask.
LLAMA_TEMPLATE_TAGGED = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
WORDS = ("the cat sat on a mat and we ask what is two plus two the answer is four hello there how are you "
         "fine thanks good morning please tell me about rivers mountains and the sea").split()


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_chat_tokenizer(directory: Path, template: str = LLAMA_TEMPLATE, vocab_size: int = 400,
                        own_pad: bool = False):
    """A BPE trained on the words above, with Llama 3's special tokens and a chat template, saved to `directory`.
    Its pad and end-of-text are one token (<|endoftext|>); with `own_pad` the end-of-text is <|eot_id|>, the end of
    a turn, and the pad stays <|endoftext|>, as in Qwen2's and Llama 3 Instruct's tokenizers (pad != eos)."""
    rng = random.Random(0)
    tok = train_bpe([sentence(rng, 30) for _ in range(300)], vocab_size)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.bos_token = "<|begin_of_text|>"
    if own_pad:
        tok.eos_token = "<|eot_id|>"
    tok.chat_template = template
    tok.save_pretrained(str(directory))
    return tok


def conversations(n: int, seed: int = 0, max_words: int = 9) -> list[dict]:
    """Chats of one or two turns, a system message in every third."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        messages = [{"role": "system", "content": "answer briefly"}] if i % 3 == 0 else []
        for _ in range(1 + i % 2):
            messages += [{"role": "user", "content": sentence(rng, rng.randint(2, max_words))},
                         {"role": "assistant", "content": sentence(rng, rng.randint(1, max_words))}]
        records.append({"messages": messages})
    return records


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def preference_pairs(n: int, seed: int = 0, conversational: bool = True) -> list[dict]:
    """{"prompt", "chosen", "rejected"} records (TRL's shape): the chosen answer starts with "yes", the rejected one
    with "no", so a model can learn which is preferred; as message lists, or as strings."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        prompt = sentence(rng, rng.randint(2, 8))
        chosen = "yes " + sentence(rng, rng.randint(1, 6))
        rejected = "no " + sentence(rng, rng.randint(1, 6))
        if conversational:
            records.append({"prompt": [{"role": "user", "content": prompt}],
                            "chosen": [{"role": "assistant", "content": chosen}],
                            "rejected": [{"role": "assistant", "content": rejected}]})
        else:
            records.append({"prompt": prompt, "chosen": " " + chosen, "rejected": " " + rejected})
    return records
