"""Preference pairs as training rows: the chosen and the rejected answer to one prompt, side by side; and KTO's
unpaired answers, each beside its KL counterpart.

A prepared preference corpus holds two examples per record (bigtrain.data.chat: the chosen answer's, then the
rejected one's), so pair k is examples 2k and 2k + 1 and a pair never straddles a shard. A batch of n pairs is
{"input_ids": [n, 2, L], "labels": [n, 2, L]}, [:, 0] chosen and [:, 1] rejected (`flat_pairs` lays them out as
TRL's concatenated forward takes them: the n chosen rows, then the n rejected rows, one pass for both), labels
-100 but on the answer's tokens (and the end-of-text after it). Rows are padded on the right with the tokenizer's
pad (`bigtrain.data.tokenizer.pad_id`), the id the model's config.pad_token_id names: a reward model's head reads each
row at its last token that is not that id, as transformers' sequence classifiers (and TRL's RewardTrainer) read a
conversation, so a row scores as the conversation alone does. An answer
cut by data.seq_len keeps its first tokens (data.long_examples=truncate) or drops its pair (drop); a pair whose
two sides are the same tokens teaches nothing and is dropped; each is counted.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from bigtrain.data.formats import UNDESIRABLE, ExampleOptions
from bigtrain.data.dataset import Batch, DataBundle, split_rows
from bigtrain.data.prepare.store import PreparedCorpus
from bigtrain.data.tokenizer import pad_id

IGNORE = -100


class AnswerRows:
    """The examples of one prepared preference corpus, each alone in a row of seq_len tokens: `take(examples)` =
    {"input_ids": [n, L], "labels": [n, L]}, labels -100 but on the answer's tokens. What a pair's two rows are
    made of, and what a reference's log-probabilities are computed over once (objective.reference=precomputed)."""

    def __init__(self, corpus: PreparedCorpus, seq_len: int, starts: np.ndarray, lengths: np.ndarray, pad_id: int):
        self.corpus, self.seq_len = corpus, seq_len
        self.starts, self.lengths = starts, lengths
        self.pad_id = pad_id

    def __len__(self) -> int:
        return len(self.starts)

    def take(self, examples: Sequence[int]) -> Batch:
        ids = np.full((len(examples), self.seq_len), self.pad_id, dtype=np.int64)
        labels = np.full((len(examples), self.seq_len), IGNORE, dtype=np.int64)
        for row, example in enumerate(examples):
            start, length = int(self.starts[example]), int(self.lengths[example])
            tokens = self.corpus.tokens(start, start + length).astype(np.int64)
            ids[row, :length] = tokens
            labels[row, :length] = np.where(self.corpus.mask(start, start + length) > 0, tokens, IGNORE)
            labels[row, 0] = IGNORE
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}


class PairRows:
    """Pairs of one prepared preference corpus; `pairs[i]` = (chosen example, rejected example). With a
    `reference` table (the reference model's log-probability of each example's answer, bigtrain.train.
    reference_logps) a batch also carries "reference_logps": [n, 2]."""

    def __init__(self, corpus: PreparedCorpus, seq_len: int, starts: np.ndarray, lengths: np.ndarray,
                 pairs: np.ndarray, pad_id: int, reference: np.ndarray | None = None):
        self.examples = AnswerRows(corpus, seq_len, starts, lengths, pad_id)
        self.corpus, self.seq_len, self.pairs, self.reference = corpus, seq_len, pairs, reference

    def __len__(self) -> int:
        return len(self.pairs)

    def take(self, indices: Sequence[int]) -> Batch:
        chosen_rejected = self.pairs[np.asarray(indices, dtype=np.int64)]  # [n, 2] example numbers
        rows = self.examples.take(chosen_rejected.reshape(-1).tolist())
        batch = {key: value.view(len(indices), 2, -1) for key, value in rows.items()}
        if self.reference is not None:
            batch["reference_logps"] = torch.from_numpy(self.reference[chosen_rejected])
        return batch


class PairCorpus:
    """One prepared preference corpus filtered for a sequence length: which pairs train, which validate."""

    def __init__(self, corpus: PreparedCorpus, seq_len: int, options: ExampleOptions, val_fraction: float,
                 source: str, pad_id: int):
        ends = corpus.document_ends()
        if len(ends) % 2:
            raise ValueError(f"{corpus.root} holds {len(ends)} examples, not pairs: prepare it again from preference "
                             "records (data.format=preference)")
        full = np.diff(ends, prepend=0)
        starts, lengths = ends - full, np.minimum(full, seq_len)
        answers = corpus.answer_starts()
        pairs = np.arange(len(ends)).reshape(-1, 2)
        has_answer = (answers < lengths)[pairs].all(axis=1)  # both sides keep an answer token within seq_len
        long = (full > seq_len)[pairs].any(axis=1)
        keep_long = ~(long & (options.long_examples == "drop"))
        # the rows as trained, cut to seq_len: answers that differ only past it teach nothing either
        same = np.array([lengths[c] == lengths[r] and np.array_equal(corpus.tokens(starts[c], starts[c] + lengths[c]),
                                                                     corpus.tokens(starts[r], starts[r] + lengths[r]))
                         for c, r in pairs], dtype=bool)
        keep = has_answer & keep_long & ~same
        self.counts = {"pairs": len(pairs), "too_long": int(long.sum()),
                       "dropped_too_long": int(long.sum()) if options.long_examples == "drop" else 0,
                       "dropped_no_answer": int((~has_answer & keep_long).sum()),
                       "dropped_same_answers": int((same & has_answer & keep_long).sum())}
        kept = np.flatnonzero(keep)
        if len(kept) < 2:
            why = ("every pair's chosen and rejected answers are the same tokens" if same.all() else
                   f"{self.counts['dropped_no_answer']} leave no answer token within data.seq_len={seq_len}, "
                   f"{self.counts['dropped_same_answers']} have the same chosen and rejected answer")
            raise ValueError(f"data.source={source!r}: {len(kept)} of {len(pairs)} preference pairs can train ({why}); "
                             "need at least 2 (one to train, one to validate): give pairs whose answers differ, or a "
                             "longer data.seq_len")
        train, val = split_rows(len(kept), val_fraction)
        self.corpus, self.seq_len, self.pad_id = corpus, seq_len, pad_id
        self.starts, self.lengths = starts, lengths
        self.train, self.val = pairs[kept[train]], pairs[kept[val]]
        self.tokens = int(lengths[self.train].sum())

    def rows(self) -> tuple[PairRows, PairRows]:
        return (PairRows(self.corpus, self.seq_len, self.starts, self.lengths, self.train, self.pad_id),
                PairRows(self.corpus, self.seq_len, self.starts, self.lengths, self.val, self.pad_id))

    def sample_prompt(self) -> list[int]:
        """A held-out pair's prompt (its chosen side up to the answer), for the end-of-run sample."""
        chosen = int(self.val[0][0])
        start = int(self.starts[chosen])
        cut = int(min(self.corpus.answer_starts()[chosen], self.lengths[chosen]))
        return self.corpus.tokens(start, start + cut).astype(np.int64).tolist()[-(self.seq_len // 2):]


def flat_pairs(batch: Batch) -> Batch:
    """[n, 2, L] pair tensors as [2n, L] rows: the n chosen rows, then the n rejected rows (for KTO the n answers,
    then their n KL counterparts); other keys as they are."""
    return {key: value.transpose(0, 1).reshape(-1, *value.shape[2:])
            if isinstance(value, torch.Tensor) and value.dim() == 3 else value for key, value in batch.items()}


class UnpairedRows:
    """KTO's answers of one prepared corpus: `examples[i]` is one answer (its prompt, its completion)."""

    def __init__(self, corpus: PreparedCorpus, seq_len: int, starts: np.ndarray, lengths: np.ndarray,
                 answers: np.ndarray, examples: np.ndarray, pad_id: int):
        self.corpus, self.seq_len = corpus, seq_len
        self.starts, self.lengths, self.answers, self.examples = starts, lengths, answers, examples
        self.pad_id = pad_id

    def __len__(self) -> int:
        return len(self.examples)

    def _parts(self, example: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(prompt tokens, completion tokens, mask value of the completion) of one example, cut to seq_len."""
        start, length, cut = int(self.starts[example]), int(self.lengths[example]), int(self.answers[example])
        tokens = self.corpus.tokens(start, start + length).astype(np.int64)
        mask = np.asarray(self.corpus.mask(start, start + length))
        return tokens[:cut], tokens[cut:], int(mask[cut:].max(initial=1))

    def take(self, indices: Sequence[int]) -> Batch:
        n, width = len(indices), self.seq_len
        ids = np.full((n, 2, width), self.pad_id, dtype=np.int64)
        labels = np.full((n, 2, width), IGNORE, dtype=np.int64)
        desirable = np.zeros(n, dtype=bool)
        parts = [self._parts(int(self.examples[int(i)])) for i in indices]
        for b, (prompt, completion, value) in enumerate(parts):
            desirable[b] = value != UNDESIRABLE
            other = parts[(b + 1) % n][1]  # the next answer in the batch, after this prompt: the KL counterpart
            for side, answer in enumerate((completion, other)):
                row = np.concatenate([prompt, answer])[:width]
                ids[b, side, :len(row)] = row
                labels[b, side, len(prompt):len(row)] = row[len(prompt):]
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "desirable": torch.from_numpy(desirable)}


def build_unpaired(corpora: list[PreparedCorpus], sources: list[str], weights: list[float] | None, seq_len: int,
                   options: ExampleOptions, val_fraction: float, tokenizer: Any) -> DataBundle:
    """The bundle of one KTO corpus, or of a weighted mixture of them: answers with a completion token within
    seq_len (a longer one cut, or dropped with data.long_examples=drop)."""
    from bigtrain.data.dataset import ConcatRows
    from bigtrain.data.mixture import MixtureSampler

    pad = pad_id(tokenizer)
    trains, vals = [], []
    counts = {"answers": 0, "desirable": 0, "dropped_no_answer": 0, "dropped_too_long": 0, "train_tokens": 0}
    for corpus, source in zip(corpora, sources):
        ends = corpus.document_ends()
        full = np.diff(ends, prepend=0)
        starts, lengths, answers = ends - full, np.minimum(full, seq_len), corpus.answer_starts()
        long = full > seq_len
        keep_long = ~(long & (options.long_examples == "drop"))
        keep = (answers < lengths) & keep_long
        kept = np.flatnonzero(keep)
        if len(kept) < 2:
            raise ValueError(f"data.source={source!r}: {len(kept)} of {len(full)} kto answers have a completion token "
                             f"within data.seq_len={seq_len}; need at least 2: give completions, or a longer seq_len")
        desirable = sum(int(np.asarray(corpus.mask(int(starts[e]) + int(answers[e]),
                                                   int(starts[e]) + int(answers[e]) + 1))[0] != UNDESIRABLE)
                        for e in kept)
        counts = {"answers": counts["answers"] + len(full), "desirable": counts["desirable"] + desirable,
                  "dropped_no_answer": counts["dropped_no_answer"] + int((~(answers < lengths) & keep_long).sum()),
                  "dropped_too_long": counts["dropped_too_long"] + int((long & ~keep_long).sum()),
                  "train_tokens": counts["train_tokens"]}
        train, val = split_rows(len(kept), val_fraction)
        counts["train_tokens"] += int(lengths[kept[train]].sum())
        trains.append(UnpairedRows(corpus, seq_len, starts, lengths, answers, kept[train], pad))
        vals.append(UnpairedRows(corpus, seq_len, starts, lengths, answers, kept[val], pad))
    stats = {**counts, "format": "kto", "layout": "unpaired", "train_answers": sum(map(len, trains)),
             "val_answers": sum(map(len, vals)), "long_examples": options.long_examples}
    stats["pad_share"] = 1.0 - stats["train_tokens"] / (stats["train_answers"] * seq_len)  # of the answers' rows
    desc = (f"kto answers {', '.join(map(repr, sources))}: {counts['answers']:,} answers ({counts['desirable']:,} "
            f"desirable; {stats['train_answers']:,} train / {stats['val_answers']:,} held out) of at most {seq_len} "
            f"tokens, each beside another answer for the KL estimate, vocab {len(tokenizer)}")
    if weights is None:
        return DataBundle(trains[0], vals[0], tokenizer, len(tokenizer), 0, desc, stats=stats, layout="unpaired")
    desc += "; mixture weights " + ", ".join(f"{w:.3g}" for w in weights)

    def make_sampler(rank: int, size: int, seed: int) -> MixtureSampler:
        return MixtureSampler([len(t) for t in trains], weights, rank, size, seed)

    return DataBundle(ConcatRows(trains), ConcatRows(vals), tokenizer, len(tokenizer), 0, desc, make_sampler,
                      stats=stats, layout="unpaired")


def build_pairs(corpora: list[PreparedCorpus], sources: list[str], weights: list[float] | None, seq_len: int,
                options: ExampleOptions, val_fraction: float, tokenizer: Any) -> DataBundle:
    """The bundle of one preference corpus, or of a weighted mixture of them."""
    from bigtrain.data.dataset import ConcatRows
    from bigtrain.data.mixture import MixtureSampler

    parts = [PairCorpus(c, seq_len, options, val_fraction, s, pad_id(tokenizer)) for c, s in zip(corpora, sources)]
    rows = [p.rows() for p in parts]
    trains, vals = [r[0] for r in rows], [r[1] for r in rows]
    stats: dict[str, Any] = {key: sum(p.counts[key] for p in parts) for key in parts[0].counts}
    stats.update(format="/".join(sorted({c.examples["format"] for c in corpora})), layout="pairs",
                 train_pairs=sum(len(t) for t in trains), val_pairs=sum(len(v) for v in vals),
                 train_tokens=sum(p.tokens for p in parts), long_examples=options.long_examples)
    stats["pad_share"] = 1.0 - stats["train_tokens"] / (2 * stats["train_pairs"] * seq_len)
    desc = (f"preference pairs {', '.join(map(repr, sources))}: {stats['pairs']:,} pairs ({stats['train_pairs']:,} "
            f"train / {stats['val_pairs']:,} held out) of at most {seq_len} tokens a side, loss on the answers")
    reasons = (("dropped_same_answers", "with the same chosen and rejected answer within seq_len"),
               ("dropped_no_answer", "with no answer token within seq_len"), ("dropped_too_long", "longer than seq_len"))
    dropped = [f"{stats[k]:,} {what}" for k, what in reasons if stats[k]]
    if dropped:
        desc += f"; dropped {', '.join(dropped)}"
    if cut := stats["too_long"] - stats["dropped_too_long"]:
        desc += f"; {cut:,} with a side longer than data.seq_len={seq_len} truncated (data.long_examples)"
    desc += f", vocab {len(tokenizer)}, from {', '.join(str(c.root) for c in corpora)}"
    prompt = parts[0].sample_prompt()
    if weights is None:
        return DataBundle(trains[0], vals[0], tokenizer, len(tokenizer), 0, desc, stats=stats, sample_prompt=prompt,
                          layout="pairs")
    desc += "; mixture weights " + ", ".join(f"{w:.3g}" for w in weights)

    def make_sampler(rank: int, size: int, seed: int) -> MixtureSampler:
        return MixtureSampler([len(t) for t in trains], weights, rank, size, seed)

    return DataBundle(ConcatRows(trains), ConcatRows(vals), tokenizer, len(tokenizer), 0, desc, make_sampler,
                      stats=stats, sample_prompt=prompt, layout="pairs")
