"""Two spawned ranks (gloo) build one data set: rank 0 writes the tokenizer and the cache, the other waits
and reads them, and each takes its own shard (the data layer in one process: tests/unit/test_data.py)."""
from __future__ import annotations

import os
import socket
from pathlib import Path

import torch

from bigtrain.data import ResumableSampler, batches, build_data

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 8 + "A second sentence about foxes and dogs.\n",
    "Packing joins documents with an end-of-text token between them so that blocks are full.\n" * 6,
    "Python's if statement selects exactly one suite by evaluating expressions one by one.\n" * 5,
]


def _write_txt(root: Path) -> list[Path]:
    paths = []
    for i, doc in enumerate(CORPUS):
        paths.append(root / f"doc{i}.txt")
        paths[-1].write_text(doc)
    return paths


def _rank_main(rank: int, port: int, root: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    bundle = build_data(str(Path(root) / "*.txt"), "text", seq_len=16, vocab_size=320,
                        tokenizer_dir=Path(root) / "tok", cache_dir=Path(root) / "cache",
                        is_writer=rank == 0, barrier=dist.barrier)
    sampler = ResumableSampler(len(bundle.train), rank, 2, seed=0)
    batch = next(batches(bundle.train, sampler, 2))
    torch.save({"val": bundle.val.take(range(len(bundle.val))), "batch": batch}, Path(root) / f"r{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_two_ranks_share_one_tokenizer_and_cache(tmp_path):
    import torch.multiprocessing as mp

    _write_txt(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_rank_main, args=(port, str(tmp_path)), nprocs=2, start_method="spawn", join=True)
    r0, r1 = (torch.load(tmp_path / f"r{r}.pt") for r in range(2))
    assert torch.equal(r0["val"]["input_ids"], r1["val"]["input_ids"])
    assert not torch.equal(r0["batch"]["input_ids"], r1["batch"]["input_ids"])  # different shards
    assert len(list((tmp_path / "cache").glob("prepared-*"))) == 1 and (tmp_path / "tok" / "tokenizer.json").is_file()
    assert not list(tmp_path.glob(".*tmp-*")) and not list((tmp_path / "cache").rglob(".*tmp-*"))
