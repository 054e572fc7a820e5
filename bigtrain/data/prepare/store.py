"""A prepare output directory: its manifest, and reading its tokens memory-mapped.

    OUT/manifest.json      written last and atomically: a directory without it is not a prepared corpus
    OUT/tokenizer/         the tokenizer the shards were made with (AutoTokenizer loads it)
    OUT/shards/00000.bin   token ids, raw, in the manifest's dtype (uint16 or uint32)
    OUT/shards/00000.idx.npy   int64 end offset (within the shard) of every document ending there
    OUT/shards/00000.json  the shard's completion marker (its piece, counts)

The corpus is the shards concatenated in order: documents joined with EOS, in source order.
A corpus of chat or instruction examples (manifest "examples") has one document per example, as
its template rendered it (no EOS added), and per shard also

    OUT/shards/00000.mask.bin  uint8 per token: 1 where the token is trained (the answer), else 0
    OUT/shards/00000.ans.npy   int64 per example: offset of its first trained token after its first
                               token (its length when it has none), to filter examples without reading masks

and records with images (manifest "vision") their images beside them (bigtrain.data.vision_store).
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import numpy as np

from bigtrain.data.vision_store import ImageStore
from bigtrain.data.vision_store import damaged as vision_damaged

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


def damaged_shards(root: str | Path, manifest: dict[str, Any]) -> dict[str, str]:
    """{shard name: what is wrong} for the manifest's shards whose files are missing or of another size
    (deleted, truncated, copied in part); empty when all are there. Stats only: nothing is read."""
    shard_dir = Path(root).expanduser() / "shards"
    itemsize = np.dtype(manifest["dtype"]).itemsize
    damaged: dict[str, str] = {}
    for shard in manifest["shards"]:
        tokens, index = shard_dir / f"{shard['name']}.bin", shard_dir / f"{shard['name']}.idx.npy"
        expected = int(shard["tokens"]) * itemsize
        if not tokens.is_file():
            damaged[shard["name"]] = f"shards/{tokens.name} is missing"
        elif tokens.stat().st_size != expected:
            damaged[shard["name"]] = (f"shards/{tokens.name} holds {tokens.stat().st_size} bytes where the manifest "
                                      f"says {shard['tokens']} tokens ({expected} bytes)")
        elif not index.is_file():
            damaged[shard["name"]] = f"shards/{index.name} is missing"
        elif "examples" in manifest:
            mask, answers = shard_dir / f"{shard['name']}.mask.bin", shard_dir / f"{shard['name']}.ans.npy"
            if not mask.is_file() or mask.stat().st_size != int(shard["tokens"]):
                damaged[shard["name"]] = f"shards/{mask.name} is missing or of another size than its tokens"
            elif not answers.is_file():
                damaged[shard["name"]] = f"shards/{answers.name} is missing"
            elif "vision" in manifest and (problem := vision_damaged(shard_dir, shard["name"], int(shard["docs"]))):
                damaged[shard["name"]] = problem
    return damaged


def is_complete(path: str | Path) -> bool:
    """Whether `path` is a finished prepare output with every shard intact."""
    return is_prepared(path) and not damaged_shards(path, read_manifest(path))


def repair_command(root: str | Path, manifest: dict[str, Any]) -> str:
    """The `bigtrain prepare` command that makes a damaged directory's shards again from its source. It
    keeps the intact shards, and reuses ROOT/tokenizer since it names none (see `prepare`)."""
    source = manifest["source"]
    argv = ["bigtrain", "prepare", "--data", source["text"], "--out", str(root)]
    if "examples" in manifest:  # the template is in ROOT/tokenizer, which the command reuses
        argv += ["--format", manifest["examples"]["format"]]
    elif source.get("text_field", "text") != "text":
        argv += ["--text-field", source["text_field"]]
    hub = source.get("hub") or {}
    if hub.get("split") not in (None, "train"):
        argv += ["--split", hub["split"]]
    if hub.get("revision"):
        argv += ["--revision", hub["revision"]]
    if source.get("hash_content"):  # the identity of the shards kept depends on how the files were hashed
        argv.append("--hash-content")
    return shlex.join(argv)


class PreparedCorpus:
    """The token stream of a prepared directory, memory-mapped shard by shard (nothing read up front)."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser()
        self.manifest = read_manifest(self.root)
        self.dtype = np.dtype(self.manifest["dtype"])
        shard_dir = self.root / "shards"
        damaged = damaged_shards(self.root, self.manifest)
        if damaged:  # deleted or truncated after prepare: say so before any rank maps a file
            shards = len(self.manifest["shards"])
            raise ValueError(f"{self.root} is incomplete: {next(iter(damaged.values()))} ({len(damaged)} of "
                             f"{shards} shards damaged or missing); run `{repair_command(self.root, self.manifest)}` "
                             f"to make {'it' if len(damaged) == 1 else 'them'} again from the source (the intact "
                             "shards are kept)")
        counts = [int(s["tokens"]) for s in self.manifest["shards"]]
        self.num_tokens = int(sum(counts))
        self.examples: dict | None = self.manifest.get("examples")  # {"format", ...} for chat/instruction data
        self._shards: list[np.ndarray] = []
        self._masks: list[np.ndarray] = []
        self._starts: list[int] = []  # global offset of each non-empty shard's first token
        start = 0
        for shard, count in zip(self.manifest["shards"], counts):
            if count:
                path = shard_dir / f"{shard['name']}.bin"
                self._shards.append(np.memmap(path, dtype=self.dtype, mode="r", shape=(count,)))
                if self.examples:
                    self._masks.append(np.memmap(path.with_suffix(".mask.bin"), dtype=np.uint8, mode="r",
                                                 shape=(count,)))
                self._starts.append(start)
            start += count
        self._bounds = np.asarray(self._starts + [self.num_tokens], dtype=np.int64)

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / "tokenizer"

    @property
    def images(self) -> ImageStore:
        """The examples' images (records with images: bigtrain.data.vision_store)."""
        assert "vision" in self.manifest, f"{self.root} holds no images"
        if getattr(self, "_images", None) is None:
            self._images = ImageStore(self.root, self.manifest["shards"])
        return self._images

    @property
    def eos_id(self) -> int:
        return int(self.manifest["tokenizer"]["eos_id"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """tokens[start:stop] of the whole stream (a copy when it spans shards)."""
        return self._read(self._shards, start, stop, self.dtype)

    def mask(self, start: int, stop: int) -> np.ndarray:
        """The trained-token mask (uint8, 1 = trained) of tokens[start:stop]; examples only."""
        assert self.examples, f"{self.root} holds text, not examples: it has no mask"
        return self._read(self._masks, start, stop, np.dtype(np.uint8))

    def answer_starts(self) -> np.ndarray:
        """Per example: the offset of its first trained token after its first (its length when none)."""
        assert self.examples, f"{self.root} holds text, not examples"
        return np.concatenate([np.load(self.root / "shards" / f"{s['name']}.ans.npy") for s in self.manifest["shards"]]
                              or [np.zeros(0, np.int64)])

    def _read(self, arrays: list[np.ndarray], start: int, stop: int, dtype: np.dtype) -> np.ndarray:
        assert 0 <= start <= stop <= self.num_tokens, (start, stop, self.num_tokens)
        first = int(np.searchsorted(self._bounds, start, side="right")) - 1
        parts = []
        while start < stop:
            shard, offset = arrays[first], start - self._starts[first]
            take = min(stop - start, len(shard) - offset)
            parts.append(shard[offset:offset + take])
            start, first = start + take, first + 1
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.zeros(0, dtype)

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
        what = f"{self.examples['format']} examples" if self.examples else "documents"
        return (f"prepared {self.root}: {m['num_docs']:,} {what}, {self.num_tokens:,} tokens ({m['dtype']}) "
                f"from {m['source']['text']!r}")
