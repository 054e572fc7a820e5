"""Prompt records served to a generating objective (GRPO, RLOO, on-policy distillation): batches of left-padded
prompts with the records they came from.

A prepared prompt corpus (bigtrain.data.prompts: one document per prompt, each record kept as a JSON line beside
its shard) becomes one index space (several corpora of a mixture one after another): `take(indices)` =

    {"prompt_ids": [n, W] left-padded (W: the batch's longest prompt), "prompt_mask": [n, W],
     "prompt_index": [n] (the prompt's number in this index space), "records": the n records themselves}

(`records(indices)` alone gives the records: every column, for the reward functions). A prompt longer than
ExampleOptions.prompt_tokens (data.seq_len - objective.max_completion_length: the room left for an answer) keeps
its last tokens (data.long_examples=truncate: TRL cuts prompts on the left too, keeping the question and the
generation prompt) or is dropped (drop); both are counted. The order is the bundle's resumable sampler's. Without
prompt_tokens (no objective that generates asked for these prompts) the bundle is refused in one line.
"""
from __future__ import annotations

import json
import mmap
from typing import Any, Sequence

import numpy as np
import torch

from bigtrain.data.dataset import Batch, DataBundle, split_rows
from bigtrain.data.formats import ExampleOptions
from bigtrain.data.prepare.store import PreparedCorpus


class RecordLines:
    """The records of one prepared prompt corpus by prompt number, read from its shards' JSON lines on demand."""

    def __init__(self, corpus: PreparedCorpus):
        self.files: list[mmap.mmap | None] = []
        self.starts: list[np.ndarray] = []  # per shard: the byte offset of each line
        counts = []
        for shard in corpus.manifest["shards"]:
            path = corpus.root / "shards" / f"{shard['name']}.records.jsonl"
            if not path.is_file():
                raise ValueError(f"{corpus.root} has no shards/{path.name} (the records of its prompts, which the "
                                 "rewards read, deleted since prepare); delete "
                                 f"{corpus.root} and prepare the source again (bigtrain prepare --format prompt)")
            view = None
            if path.stat().st_size:
                with open(path, "rb") as f:
                    view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            data = np.frombuffer(view, dtype=np.uint8) if view is not None else np.zeros(0, np.uint8)
            ends = np.flatnonzero(data == 10) + 1
            if len(ends) != int(shard["docs"]):
                raise ValueError(f"{path} holds {len(ends)} records for the shard's {shard['docs']} prompts: it "
                                 "changed since prepare; prepare the source again")
            self.files.append(view)
            self.starts.append(np.concatenate([[0], ends[:-1]]).astype(np.int64))
            counts.append(len(ends))
        self.offsets = np.cumsum([0] + counts)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, number: int) -> dict:
        shard = int(np.searchsorted(self.offsets, number, side="right")) - 1
        local = number - int(self.offsets[shard])
        start = int(self.starts[shard][local])
        view = self.files[shard]
        assert view is not None
        end = view.find(b"\n", start)
        return json.loads(view[start:end].decode("utf-8"))


class PromptPart:
    """One corpus's prompts that can be served: token spans, the numbers of the kept ones, their records."""

    def __init__(self, corpus: PreparedCorpus, limit: int, options: ExampleOptions, source: str):
        ends = corpus.document_ends()
        lengths = np.diff(ends, prepend=0)
        self.corpus, self.limit, self.starts, self.lengths = corpus, limit, ends - lengths, lengths
        self.records = RecordLines(corpus)
        long = lengths > limit
        keep = ~long if options.long_examples == "drop" else np.ones(len(lengths), dtype=bool)
        self.kept = np.flatnonzero(keep)
        self.counts = {"prompts": len(lengths), "too_long": int(long.sum()),
                       "dropped_too_long": int((long & ~keep).sum()),
                       "cut_too_long": int((long & keep).sum()), "longest_prompt": int(lengths.max(initial=0))}
        if len(self.kept) < 2:
            raise ValueError(f"data.source={source!r}: {len(self.kept)} of {len(lengths)} prompts fit the "
                             f"{limit} tokens left for a prompt (data.seq_len - objective.max_completion_length); "
                             "need at least 2 (one to train, one to validate): give shorter prompts, a longer "
                             "data.seq_len or a shorter max_completion_length, or data.long_examples=truncate")

    def tokens(self, example: int) -> np.ndarray:
        start, length = int(self.starts[example]), int(self.lengths[example])
        cut = max(0, length - self.limit)  # a long prompt keeps its end
        return self.corpus.tokens(start + cut, start + length).astype(np.int64)


class PromptRows:
    """Prompts of one or more parts as one index space: part p's kept prompts `rows[p]`, one after another."""

    def __init__(self, parts: list[PromptPart], rows: list[np.ndarray], pad_id: int):
        self.parts, self.rows, self.pad_id = parts, rows, pad_id
        self.offsets = np.cumsum([0] + [len(r) for r in rows])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _locate(self, index: int) -> tuple[PromptPart, int]:
        p = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return self.parts[p], int(self.parts[p].kept[self.rows[p][index - int(self.offsets[p])]])

    def take(self, indices: Sequence[int]) -> Batch:
        prompts = [part.tokens(example) for part, example in map(self._locate, map(int, indices))]
        width = max(map(len, prompts))
        ids = np.full((len(prompts), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(prompts), width), dtype=np.int64)
        for row, tokens in enumerate(prompts):
            ids[row, width - len(tokens):], mask[row, width - len(tokens):] = tokens, 1
        return {"prompt_ids": torch.from_numpy(ids), "prompt_mask": torch.from_numpy(mask),
                "prompt_index": torch.tensor([int(i) for i in indices], dtype=torch.int64),
                "records": self.records(indices)}

    def records(self, indices: Sequence[int]) -> list[dict]:
        """The records of these prompts (`prompt_index` values), every column as the source had it."""
        out = []
        for index in indices:
            part, example = self._locate(int(index))
            out.append(part.records[example])
        return out


def build_prompts(corpora: list[PreparedCorpus], sources: list[str], weights: list[float] | None, seq_len: int,
                  options: ExampleOptions, val_fraction: float, tokenizer: Any) -> DataBundle:
    """The bundle of one prepared prompt corpus, or of a weighted mixture of them (layout "prompts")."""
    from bigtrain.data.mixture import MixtureSampler

    if options.prompt_tokens is None:  # set by an objective that generates: the room its completions leave
        raise ValueError("data.format=prompt: prompt records are for an objective that generates its answers "
                         "(online RL: objective.kind=grpo, rloo or distill); for supervised fine-tuning give records "
                         "with answers (data.format=prompt_completion, chat, ...)")
    limit = options.prompt_tokens
    if limit < 1:
        raise ValueError(f"prompt records: data.seq_len={seq_len} leaves {limit} tokens for a prompt after the "
                         "completion (objective.max_completion_length): make seq_len longer or the completion shorter")
    parts = [PromptPart(c, limit, options, s) for c, s in zip(corpora, sources)]
    splits = [split_rows(len(p.kept), val_fraction) for p in parts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else corpora[0].eos_id
    train = PromptRows(parts, [t for t, _ in splits], pad)
    val = PromptRows(parts, [v for _, v in splits], pad)
    stats: dict[str, Any] = {k: sum(p.counts[k] for p in parts) for k in parts[0].counts if k != "longest_prompt"}
    stats.update(format="prompt", layout="prompts", train_prompts=len(train), val_prompts=len(val),
                 prompt_tokens=limit, longest_prompt=max(p.counts["longest_prompt"] for p in parts),
                 long_examples=options.long_examples)
    desc = (f"prompts {', '.join(map(repr, sources))}: {stats['prompts']:,} ({len(train):,} train / {len(val):,} "
            f"held out) of at most {limit} tokens, left-padded for generation")
    if stats["too_long"]:
        what = "dropped" if options.long_examples == "drop" else "cut to their last tokens"
        desc += f"; {stats['too_long']:,} longer {what}"
    desc += f", vocab {len(tokenizer)}, from {', '.join(str(c.root) for c in corpora)}"
    sample = val.take([0])
    prompt = sample["prompt_ids"][0][sample["prompt_mask"][0].bool()].tolist()
    if weights is None:
        return DataBundle(train, val, tokenizer, len(tokenizer), 0, desc, stats=stats, sample_prompt=prompt,
                          layout="prompts")
    desc += "; mixture weights " + ", ".join(f"{w:.3g}" for w in weights)

    def make_sampler(rank: int, size: int, seed: int) -> MixtureSampler:
        return MixtureSampler([len(t) for t, _ in splits], weights, rank, size, seed)

    return DataBundle(train, val, tokenizer, len(tokenizer), 0, desc, make_sampler, stats=stats, sample_prompt=prompt,
                      layout="prompts")


PLACEHOLDER_PROMPT = [{"role": "user", "content": ""}]  # TRL's prompt of records an environment fills
PLACEHOLDERS = 4096  # records of the index space (the sampler cycles through it in passes)


class PlaceholderPrompts:
    """`count` records of one empty user message (TRL's placeholder dataset), for an objective whose rollouts make
    their prompts (an environment's reset returns each): served as prompt records are, their prompt the template's
    render of that message."""

    def __init__(self, count: int, ids: list[int], pad_id: int):
        self.count, self.ids, self.pad_id = count, ids, pad_id

    def __len__(self) -> int:
        return self.count

    def take(self, indices: Sequence[int]) -> Batch:
        n = len(indices)
        ids = torch.tensor([self.ids] * n, dtype=torch.int64)
        return {"prompt_ids": ids, "prompt_mask": torch.ones_like(ids),
                "prompt_index": torch.tensor([int(i) for i in indices], dtype=torch.int64),
                "records": self.records(indices)}

    def records(self, indices: Sequence[int]) -> list[dict]:
        return [{"prompt": [dict(m) for m in PLACEHOLDER_PROMPT]} for _ in indices]


def placeholder_prompts(tokenizer: Any, val_fraction: float) -> DataBundle:
    """The bundle of an objective's own prompts (no data.source given): PLACEHOLDERS records of an empty user
    message, rendered by the tokenizer's chat template (one line without one)."""
    from bigtrain.data.chat import no_template_line
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(no_template_line(tokenizer, "objective.environment without data"))
    ids = list(tokenizer.apply_chat_template(PLACEHOLDER_PROMPT, add_generation_prompt=True, tokenize=True,
                                             return_dict=False))
    train_rows, val_rows = split_rows(PLACEHOLDERS, val_fraction)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stats = {"format": "prompt", "layout": "prompts", "prompts": 0, "placeholder_prompts": True}
    return DataBundle(PlaceholderPrompts(len(train_rows), ids, pad), PlaceholderPrompts(len(val_rows), ids, pad),
                      tokenizer, len(tokenizer), 0, "no data: each prompt made by the environment's reset (records of "
                      "one empty user message, TRL's placeholder)", stats=stats, sample_prompt=ids, layout="prompts")
