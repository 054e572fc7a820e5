"""A prepare output directory: its manifest, and reading its tokens memory-mapped.

    OUT/manifest.json      written last and atomically: a directory without it is not a prepared corpus
    OUT/tokenizer/         the tokenizer the shards were made with (AutoTokenizer loads it)
    OUT/shards/00000.bin   token ids, raw, in the manifest's dtype (uint16 or uint32)
    OUT/shards/00000.idx.npy   int64 end offset (within the shard) of every document ending there
    OUT/shards/00000.json  the shard's completion marker (its piece, counts)

The corpus is the shards concatenated in order: documents joined with EOS, in source order.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "bigtrain-tokens-v1"
MANIFEST = "manifest.json"
PLAN_FILE = "plan.json"  # what an unfinished prepare is making (its identity); present before the manifest


def is_prepared(path: str | Path) -> bool:
    """Whether `path` is a finished prepare output (has its manifest)."""
    return (Path(path).expanduser() / MANIFEST).is_file()


def read_manifest(root: str | Path) -> dict[str, Any]:
    """The manifest of a prepared directory; ValueError naming the fix when it is absent or foreign."""
    root = Path(root).expanduser()
    path = root / MANIFEST
    if not path.is_file():
        raise ValueError(f"{root} is not a prepared corpus (no {MANIFEST}; an unfinished prepare leaves none): "
                         f"run `bigtrain prepare --data SRC --out {root}` again to finish it")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, this bigtrain reads {FORMAT!r}; "
                         "prepare the data again with this version")
    return manifest


class PreparedCorpus:
    """The token stream of a prepared directory, memory-mapped shard by shard (nothing read up front)."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser()
        self.manifest = read_manifest(self.root)
        self.dtype = np.dtype(self.manifest["dtype"])
        shard_dir = self.root / "shards"
        counts = [int(s["tokens"]) for s in self.manifest["shards"]]
        self.num_tokens = int(sum(counts))
        self._shards: list[np.ndarray] = []
        self._starts: list[int] = []  # global offset of each non-empty shard's first token
        start = 0
        for shard, count in zip(self.manifest["shards"], counts):
            if count:
                path = shard_dir / f"{shard['name']}.bin"
                if path.stat().st_size != count * self.dtype.itemsize:
                    raise ValueError(f"{path} holds {path.stat().st_size} bytes, the manifest says {count} tokens: "
                                     "the prepared data was changed after prepare; prepare it again")
                self._shards.append(np.memmap(path, dtype=self.dtype, mode="r", shape=(count,)))
                self._starts.append(start)
            start += count
        self._bounds = np.asarray(self._starts + [self.num_tokens], dtype=np.int64)

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / "tokenizer"

    @property
    def eos_id(self) -> int:
        return int(self.manifest["tokenizer"]["eos_id"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """tokens[start:stop] of the whole stream (a copy when it spans shards)."""
        assert 0 <= start <= stop <= self.num_tokens, (start, stop, self.num_tokens)
        first = int(np.searchsorted(self._bounds, start, side="right")) - 1
        parts = []
        while start < stop:
            shard, offset = self._shards[first], start - self._starts[first]
            take = min(stop - start, len(shard) - offset)
            parts.append(shard[offset:offset + take])
            start, first = start + take, first + 1
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.zeros(0, self.dtype)

    def document_ends(self) -> np.ndarray:
        """End offset of every document in the whole stream (reads the small index files)."""
        ends, start = [], 0
        for shard in self.manifest["shards"]:
            index = np.load(self.root / "shards" / f"{shard['name']}.idx.npy")
            ends.append(index + start)
            start += int(shard["tokens"])
        return np.concatenate(ends) if ends else np.zeros(0, np.int64)

    def describe(self) -> str:
        m = self.manifest
        return (f"prepared {self.root}: {m['num_docs']:,} documents, {self.num_tokens:,} tokens ({m['dtype']}) "
                f"from {m['source']['text']!r}")
