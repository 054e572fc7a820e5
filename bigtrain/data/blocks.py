"""Training samples cut from a prepared token stream: blocks of seq_len + 1 tokens that overlap by one.

Block i is tokens[i*L : i*L + L + 1]: the model reads the first L tokens and predicts the
next token at each of them, so the last token of block i is both the final target of block i
and the first input of block i + 1. No token is lost as a target at a block edge; the only
tokens never trained on are the tail after the last full block (fewer than L + 1) and the
very first token of the corpus (nothing precedes it). A batch is
{"input_ids": [B, L], "labels": [B, L + 1]}: labels carry the block whole, and the causal LM
loss takes the targets as labels[:, 1:].
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from bigtrain.data.dataset import Batch
from bigtrain.data.prepare.store import PreparedCorpus


def block_count(num_tokens: int, seq_len: int) -> int:
    """Full blocks of seq_len + 1 tokens in a stream of num_tokens (consecutive blocks share one token)."""
    return max(0, (num_tokens - 1) // seq_len)


def to_batch(blocks: np.ndarray) -> Batch:
    """[B, L + 1] token blocks -> the model's batch (int64, as embeddings and losses want)."""
    ids = torch.from_numpy(blocks.astype(np.int64))
    return {"input_ids": ids[:, :-1], "labels": ids}


class TokenBlocks:
    """The blocks of one prepared corpus (or some of them: `rows`), read from the memory-mapped shards."""

    def __init__(self, corpus: PreparedCorpus, seq_len: int, rows: np.ndarray | None = None):
        self.corpus, self.seq_len = corpus, seq_len
        self.rows = np.arange(block_count(corpus.num_tokens, seq_len)) if rows is None else rows

    def __len__(self) -> int:
        return len(self.rows)

    def blocks(self, indices: Sequence[int]) -> np.ndarray:
        """[len(indices), seq_len + 1] tokens of these samples."""
        out = np.empty((len(indices), self.seq_len + 1), dtype=self.corpus.dtype)
        for n, row in enumerate(self.rows[np.asarray(indices, dtype=np.int64)]):
            start = int(row) * self.seq_len
            out[n] = self.corpus.tokens(start, start + self.seq_len + 1)
        return out

    def take(self, indices: Sequence[int]) -> Batch:
        return to_batch(self.blocks(indices))

    def subset(self, rows: np.ndarray) -> "TokenBlocks":
        return TokenBlocks(self.corpus, self.seq_len, self.rows[rows])
