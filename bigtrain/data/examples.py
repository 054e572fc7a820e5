"""Training rows of chat and instruction examples: one example per row (padded), or several packed into one.

A batch is {"input_ids": [B, L], "labels": [B, L]}, plus "position_ids": [B, L] when packed. Labels are
aligned with the inputs (the loss predicts labels[:, 1:] from what precedes them, `models.losses.lm_targets`)
and hold the token where it is trained, else -100: prompt tokens (unless data.train_on_prompt), padding, and
the first token of every example, which nothing of its own example precedes (in a packed row the token
before it is another example's last: predicting across would be cross-talk in the loss).

Packing (data.packing) fills each row with several examples, best-fit decreasing (as TRL's "bfd"), and
restarts position_ids at 0 at every example (the padding after the last one too). transformers (5.x) reads
restarting positions as packed sequences and masks attention to each one's own tokens (masking_utils:
`find_packed_sequence_indices`, for sdpa, eager and flex attention); with that, every packed example gets
the loss it gets alone, in less padding. Examples longer than L are cut to their first L tokens or dropped
(data.long_examples); examples left without a trained token are dropped. Both are counted.
"""
from __future__ import annotations

import bisect
from typing import Any, Sequence

import numpy as np
import torch

from bigtrain.data.formats import ExampleOptions
from bigtrain.data.dataset import Batch, ConcatRows, DataBundle, split_rows
from bigtrain.data.prepare.store import PreparedCorpus

IGNORE = -100


class ExampleRows:
    """Rows of one prepared example corpus; row r holds examples members[offsets[r]:offsets[r + 1]]."""

    def __init__(self, corpus: PreparedCorpus, seq_len: int, starts: np.ndarray, lengths: np.ndarray,
                 members: np.ndarray, offsets: np.ndarray, train_on_prompt: bool, packed: bool,
                 rows: np.ndarray | None = None):
        self.corpus, self.seq_len = corpus, seq_len
        self.starts, self.lengths = starts, lengths  # per example of the corpus (lengths already cut to seq_len)
        self.members, self.offsets = members, offsets
        self.train_on_prompt, self.packed = train_on_prompt, packed
        self.rows = np.arange(len(offsets) - 1) if rows is None else rows
        self.pad_id = corpus.eos_id  # never a target, and after every real token: causal attention ignores it

    def __len__(self) -> int:
        return len(self.rows)

    def row_examples(self, index: int) -> np.ndarray:
        row = self.rows[index]
        return self.members[self.offsets[row]:self.offsets[row + 1]]

    def take(self, indices: Sequence[int]) -> Batch:
        n, width = len(indices), self.seq_len
        ids = np.full((n, width), self.pad_id, dtype=np.int64)
        labels = np.full((n, width), IGNORE, dtype=np.int64)
        positions = np.zeros((n, width), dtype=np.int64)
        for b, index in enumerate(indices):
            at = 0
            for example in self.row_examples(int(index)):
                start, length = int(self.starts[example]), int(self.lengths[example])
                tokens = self.corpus.tokens(start, start + length).astype(np.int64)
                trained = tokens if self.train_on_prompt else np.where(self.corpus.mask(start, start + length) > 0,
                                                                       tokens, IGNORE)
                ids[b, at:at + length] = tokens
                labels[b, at:at + length] = trained
                labels[b, at] = IGNORE  # nothing of this example precedes its first token
                positions[b, at:at + length] = np.arange(length)
                at += length
            positions[b, at:] = np.arange(width - at)  # padding: a run of its own, attended by nothing real
        batch = {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}
        if self.packed:
            batch["position_ids"] = torch.from_numpy(positions)
        return batch

    def subset(self, rows: np.ndarray) -> "ExampleRows":
        return ExampleRows(self.corpus, self.seq_len, self.starts, self.lengths, self.members, self.offsets,
                           self.train_on_prompt, self.packed, self.rows[rows])


def pack(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Best-fit decreasing: each example, longest first, goes into the fullest row it fits in (a new row when
    none has room). Deterministic; O(n log n) plus the sorted list of distinct free spaces (at most capacity)."""
    rows: list[list[int]] = []
    spaces: list[int] = []  # distinct free spaces some row has, sorted
    rows_with: dict[int, list[int]] = {}  # free space -> rows with exactly that much
    for example in np.argsort(-lengths, kind="stable"):
        need = int(lengths[example])
        k = bisect.bisect_left(spaces, need)
        if k == len(spaces):
            row, free = len(rows), capacity - need
            rows.append([int(example)])
        else:
            space = spaces[k]
            row = rows_with[space].pop()
            if not rows_with[space]:
                del rows_with[space]
                spaces.pop(k)
            rows[row].append(int(example))
            free = space - need
        if free > 0:
            if free not in rows_with:
                rows_with[free] = []
                bisect.insort(spaces, free)
            rows_with[free].append(row)
    return rows


def _csr(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    members = np.asarray([e for row in rows for e in row], dtype=np.int64)
    offsets = np.cumsum([0] + [len(row) for row in rows]).astype(np.int64)
    return members, offsets


class ExampleCorpus:
    """One prepared example corpus filtered for a sequence length: which examples train, which validate."""

    def __init__(self, corpus: PreparedCorpus, seq_len: int, options: ExampleOptions, val_fraction: float,
                 source: str):
        ends = corpus.document_ends()
        full = np.diff(ends, prepend=0)
        self.corpus, self.seq_len, self.options = corpus, seq_len, options
        self.starts, self.lengths = ends - full, np.minimum(full, seq_len)
        answers = corpus.answer_starts()
        has_target = self.lengths >= 2 if options.train_on_prompt else answers < self.lengths
        long = full > seq_len
        keep_long = ~(long & (options.long_examples == "drop"))
        keep = has_target & keep_long
        self.counts = {"examples": len(full), "too_long": int(long.sum()),
                       "truncated": int((long & keep).sum()) if options.long_examples == "truncate" else 0,
                       "dropped_too_long": int(long.sum()) if options.long_examples == "drop" else 0,
                       "dropped_no_answer": int((~has_target & keep_long).sum()),
                       # of those: no answer at all (no assistant turn, an empty completion), not cut off
                       "no_answer": 0 if options.train_on_prompt else int(((answers >= full) & keep_long).sum())}
        kept = np.flatnonzero(keep)
        if len(kept) < 2:
            if self.counts["no_answer"] > len(full) - 2:
                fix = ("give records with an answer to train on (an assistant turn, a non-empty completion or "
                       "output), or data.train_on_prompt=true to train on every token")
            else:
                fix = "raise data.seq_len or use more data"
            raise ValueError(f"data.source={source!r}: {len(kept)} of {len(full)} examples have an answer token "
                             f"within data.seq_len={seq_len} ({self.counts['no_answer']} have none at all, "
                             f"{self.counts['too_long']} are longer than data.seq_len); need at least 2 (one to "
                             f"train, one to validate): {fix}")
        train, val = split_rows(len(kept), val_fraction)
        self.train_examples, self.val_examples = kept[train], kept[val]

    def rows(self, packed: bool) -> tuple[ExampleRows, ExampleRows]:
        """Train rows (packed or one example each) and validation rows (one held-out example each: a validation
        loss that does not depend on packing)."""
        tp = self.options.train_on_prompt
        if packed:
            groups = pack(self.lengths[self.train_examples], self.seq_len)
            members, offsets = _csr([[int(self.train_examples[i]) for i in group] for group in groups])
        else:
            members, offsets = self.train_examples, np.arange(len(self.train_examples) + 1)
        val = self.val_examples, np.arange(len(self.val_examples) + 1)
        return (ExampleRows(self.corpus, self.seq_len, self.starts, self.lengths, members, offsets, tp, packed),
                ExampleRows(self.corpus, self.seq_len, self.starts, self.lengths, *val, tp, False))

    def sample_prompt(self) -> list[int]:
        """A held-out example's prompt, as the model is asked it at inference: its tokens up to where its last
        answer starts (for a chat, the conversation so far and the assistant's generation prompt)."""
        best: list[int] = []
        for example in self.val_examples[:16]:  # a short prompt leaves room for the answer
            start, length = int(self.starts[example]), int(self.lengths[example])
            mask = np.asarray(self.corpus.mask(start, start + length))
            runs = np.flatnonzero((mask[1:] > 0) & (mask[:-1] == 0)) + 1
            cut = int(runs[-1]) if len(runs) else length
            prompt = self.corpus.tokens(start, start + cut).astype(np.int64).tolist()
            if not best or len(prompt) < len(best):
                best = prompt
            if len(best) <= self.seq_len // 2:
                break
        return best[-(self.seq_len // 2):]


def build_examples(corpora: list[PreparedCorpus], sources: list[str], weights: list[float] | None, seq_len: int,
                   options: ExampleOptions, val_fraction: float, tokenizer: Any) -> DataBundle:
    """The bundle of one example corpus, or of a weighted mixture of them (one format each, any mix)."""
    from bigtrain.data.mixture import MixtureSampler

    parts = [ExampleCorpus(c, seq_len, options, val_fraction, s) for c, s in zip(corpora, sources)]
    rows = [p.rows(options.packing) for p in parts]
    trains, vals = [r[0] for r in rows], [r[1] for r in rows]
    stats = example_stats(parts, trains, options)
    formats = sorted({c.examples["format"] for c in corpora})
    desc = (f"{'/'.join(formats)} examples {', '.join(map(repr, sources))}: {describe(stats, seq_len)}, vocab "
            f"{len(tokenizer)}, from {', '.join(str(c.root) for c in corpora)}")
    prompt = parts[0].sample_prompt()
    if weights is None:
        return DataBundle(trains[0], vals[0], tokenizer, len(tokenizer), 0, desc, stats=stats, sample_prompt=prompt)
    desc += "; mixture weights " + ", ".join(f"{w:.3g}" for w in weights)

    def make_sampler(rank: int, size: int, seed: int) -> MixtureSampler:
        return MixtureSampler([len(t) for t in trains], weights, rank, size, seed)

    return DataBundle(ConcatRows(trains), ConcatRows(vals), tokenizer, len(tokenizer), 0, desc, make_sampler,
                      stats=stats, sample_prompt=prompt)


def example_stats(parts: list[ExampleCorpus], trains: list[ExampleRows], options: ExampleOptions) -> dict:
    """Counts and padding of the training rows, with and without packing (what summary.json keeps)."""
    stats: dict[str, Any] = {key: sum(p.counts[key] for p in parts) for key in parts[0].counts}
    tokens = sum(int(p.lengths[p.train_examples].sum()) for p in parts)
    examples = sum(len(p.train_examples) for p in parts)
    seq_len = parts[0].seq_len
    stats.update(format="/".join(sorted({p.corpus.examples["format"] for p in parts})),
                 train_examples=examples, val_examples=sum(len(p.val_examples) for p in parts),
                 train_rows=sum(len(t) for t in trains), train_tokens=tokens, packing=options.packing,
                 train_on_prompt=options.train_on_prompt, long_examples=options.long_examples,
                 pad_share_unpacked=1.0 - tokens / (examples * seq_len))
    if options.packing:
        stats["pad_share_packed"] = 1.0 - tokens / (stats["train_rows"] * seq_len)
    stats["pad_share"] = stats["pad_share_packed"] if options.packing else stats["pad_share_unpacked"]
    return stats


def describe(stats: dict, seq_len: int) -> str:
    """One line: the examples, what trains, what was cut or dropped, and the padding saved by packing."""
    line = (f"{stats['examples']:,} examples ({stats['train_examples']:,} train / {stats['val_examples']:,} held out)"
            f" of at most {seq_len} tokens, loss on {'every token' if stats['train_on_prompt'] else 'answers only'}")
    if stats["too_long"]:
        line += (f"; {stats['too_long']:,} longer than data.seq_len={seq_len} "
                 f"{'truncated' if stats['truncated'] else 'dropped'}")
    if stats["dropped_no_answer"]:
        cut = stats["dropped_no_answer"] - stats["no_answer"]
        parts = ([f"{stats['no_answer']:,} without an answer (no assistant turn, an empty completion)"]
                 if stats["no_answer"] else []) + ([f"{cut:,} whose answer starts after data.seq_len"] if cut else [])
        line += f"; {' and '.join(parts)} dropped"
    if stats["packing"]:
        line += (f"; packed into {stats['train_rows']:,} rows: padding {stats['pad_share_unpacked']:.1%} of the tokens "
                 f"unpacked -> {stats['pad_share_packed']:.1%} packed")
    else:
        line += f"; padding {stats['pad_share_unpacked']:.1%} of the tokens (data.packing=true packs them)"
    return line
