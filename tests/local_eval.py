"""A local lm-eval task folder and text to train on, for the evaluation tests of both tiers (tests/unit/test_eval.py,
tests/dist/test_eval_runs.py). No download: the tasks read a jsonl written here (dataset_path: json, data_files).

The tasks ask what animals do ("the cow" -> " moos"): `sounds_mc` (multiple choice among four sounds),
`sounds_next` (loglikelihood of the right sound: its perplexity and whether it is the greedy continuation) and
`sounds_ppl` (loglikelihood_rolling over the whole sentence: word and byte perplexity) and `sounds_gen` (greedy
generation up to the full stop, exact match). `sounds_corpus` is text
that teaches the answers; `builtin` documents (Python's docs) are the other text a model can learn from instead.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

SOUNDS = {"cow": "moo", "dog": "woof", "cat": "meow", "duck": "quack", "sheep": "baa", "owl": "hoot",
          "lion": "roar", "frog": "croak"}
TASKS = ("sounds_mc", "sounds_next", "sounds_ppl", "sounds_gen")
DOCS = 24


def verb(animal: str) -> str:
    return f"{SOUNDS[animal]}s"


def sentence(animal: str) -> str:
    """'the cow moos.': the sound right after its animal, so a tiny model learns it in a few dozen steps."""
    return f"the {animal} {verb(animal)}."


def write_documents(path: Path) -> Path:
    """DOCS questions, three per animal, each with four choices (the right sound among them) in a seeded order."""
    rng = random.Random(0)
    animals = sorted(SOUNDS)
    with path.open("w") as f:
        for i in range(DOCS):
            animal = animals[i % len(animals)]
            wrong = rng.sample([verb(a) for a in animals if a != animal], 3)
            choices = [verb(animal), *wrong]
            rng.shuffle(choices)
            f.write(json.dumps({"animal": animal, "choices": choices, "label": choices.index(verb(animal)),
                                "sound": verb(animal), "text": sentence(animal)}) + "\n")
    return path


def make_task_folder(root: Path) -> Path:
    """ROOT/tasks: the four task YAML files and their sounds.jsonl, as a user writes a local task."""
    folder = root / "tasks"
    folder.mkdir(parents=True, exist_ok=True)
    data = write_documents(folder / "sounds.jsonl")
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n")
    (folder / "sounds_mc.yaml").write_text(
        f"task: sounds_mc\n{common}output_type: multiple_choice\n"
        "doc_to_text: \"the {{animal}}\"\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (folder / "sounds_next.yaml").write_text(
        f"task: sounds_next\n{common}output_type: loglikelihood\n"
        "doc_to_text: \"the {{animal}}\"\ndoc_to_target: \" {{sound}}.\"\n"
        "metric_list:\n  - metric: perplexity\n  - metric: acc\n")
    (folder / "sounds_ppl.yaml").write_text(
        f"task: sounds_ppl\n{common}output_type: loglikelihood_rolling\n"
        "doc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    (folder / "sounds_gen.yaml").write_text(
        f"task: sounds_gen\n{common}output_type: generate_until\n"
        "doc_to_text: \"the {{animal}}\"\ndoc_to_target: \" {{sound}}\"\n"
        "generation_kwargs:\n  until: [\".\"]\n  max_gen_toks: 4\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    return folder


def sounds_corpus(path: Path, sentences: int = 3000) -> Path:
    """Text that teaches the tasks' answers: the eight sentences in a seeded random order."""
    rng = random.Random(1)
    animals = sorted(SOUNDS)
    path.write_text("".join(sentence(rng.choice(animals)) + "\n" for _ in range(sentences)))
    return path


def make_eval_files(root: Path) -> dict[str, Path]:
    """{"tasks": folder, "sounds": corpus.txt, "other": corpus of Python's docs, "tokenizer": dir, "llama": dir}:
    one BPE trained on both corpora (so both runs read the same tokens), and a tiny Llama with random weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bigtrain.data.builtin import builtin_documents
    from bigtrain.data.tokenizer import train_bpe

    root.mkdir(parents=True, exist_ok=True)
    tasks = make_task_folder(root)
    sounds = sounds_corpus(root / "sounds.txt")
    docs = builtin_documents()[:30]
    other = root / "other.txt"
    other.write_text("".join(docs))
    tok = train_bpe([*docs, sounds.read_text()], 400)
    tok.save_pretrained(root / "tokenizer")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                 tie_word_embeddings=False)).save_pretrained(root / "llama")
    tok.save_pretrained(root / "llama")
    return {"tasks": tasks, "sounds": sounds, "other": other, "tokenizer": root / "tokenizer", "llama": root / "llama"}
