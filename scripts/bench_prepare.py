"""Benchmark of data preparation: `bigtrain prepare` against bigtrain's old in-run path and a nanoGPT-style script.

    .venv/bin/python scripts/bench_prepare.py --work /tmp/bench_prepare --sizes 0.3,1,3

Makes jsonl corpora of the given sizes (GB) from text that ships with Python (the reference
topics of pydoc_data and the docstrings of the standard library, recombined into varied
documents), trains one byte-level BPE (vocab 4096) for every runner, and measures for each
(runner, size): wall time, MB/s of input, CPU seconds, and the peak RSS and PSS of the whole
process tree (sampled every 0.5 s). Runners:

  prepare-N   `bigtrain prepare --num-proc N` (python -m bigtrain.data.prepare.cli)
  old         bigtrain's in-run path before prepare existed (bigtrain/data at --old-commit, from git):
              datasets' json loader -> one Python list -> one tokenizer call stream -> one .npy
  nanogpt-N   nanoGPT's data/openwebtext/prepare.py recipe: datasets.map(num_proc=N) + np.memmap (uint16)

and the time from launching `python bigtrain/run.py --data PREPARED` (tiny GPT-2, one process) to its
first training step on the largest prepared corpus. Results go to WORK/results.json (appended case by
case, so an interrupted run keeps what it measured) and a markdown table on stdout. Corpora and
outputs stay under --work; --clean deletes them at the end.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import random
import resource
import selectors
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
sys.path.insert(0, str(REPO))

from bigtrain.atomic import replacing  # noqa: E402

OLD_PATH = """
import sys, time
t = time.perf_counter()
from bigtrain.data import build_data
bundle = build_data(sys.argv[1], "text", seq_len=256, tokenizer=sys.argv[2], tokenizer_dir=sys.argv[3] + "/tok",
                    cache_dir=sys.argv[3] + "/cache")
print(bundle.description, f"in {time.perf_counter() - t:.1f} s", flush=True)
"""

NANOGPT = """
# nanoGPT data/openwebtext/prepare.py, with a local tokenizer in place of tiktoken's gpt2
import sys, numpy as np
from datasets import load_dataset
from tokenizers import Tokenizer
corpus, tok_dir, out, num_proc, cache = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
enc = Tokenizer.from_file(tok_dir + "/tokenizer.json")
eos = enc.token_to_id("<|endoftext|>")
ds = load_dataset("json", data_files=corpus, split="train", num_proc=num_proc, cache_dir=cache)
def process(example):
    ids = enc.encode(example["text"], add_special_tokens=False).ids
    ids.append(eos)
    return {"ids": ids, "len": len(ids)}
tokenized = ds.map(process, remove_columns=["text"], desc="tokenizing", num_proc=num_proc)
arr_len = np.sum(tokenized["len"], dtype=np.uint64)
arr = np.memmap(out, dtype=np.uint16, mode="w+", shape=(arr_len,))
total_batches, idx = 1024, 0
for batch_idx in range(total_batches):
    batch = tokenized.shard(num_shards=total_batches, index=batch_idx, contiguous=True).with_format("numpy")
    arr_batch = np.concatenate(batch["ids"])
    arr[idx:idx + len(arr_batch)] = arr_batch
    idx += len(arr_batch)
arr.flush()
print(f"{arr_len} tokens", flush=True)
"""


# --- corpora ------------------------------------------------------------------------------------------------

def paragraphs() -> list[str]:
    """Prose paragraphs from pydoc's topics and the stdlib's docstrings (read with ast: nothing is imported)."""
    from pydoc_data.topics import topics
    out = [p.strip() for t in topics.values() for p in t.split("\n\n") if len(p.strip()) > 80]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    out += [p.strip() for p in doc.split("\n\n") if len(p.strip()) > 80]
    return out


def make_corpus(path: Path, gigabytes: float, seed: int = 0) -> None:
    """jsonl of documents of 2-40 paragraphs drawn at random (varied lengths, topics and order)."""
    if path.exists() and path.stat().st_size >= gigabytes * 1e9:
        return
    pool = paragraphs()
    rng = random.Random(seed)
    target = int(gigabytes * 1e9)
    with replacing(path, "w", encoding="utf-8") as f:
        while f.tell() < target:
            lines = []
            for _ in range(1000):
                doc = "\n\n".join(rng.choices(pool, k=rng.randint(2, 40)))
                lines.append(json.dumps({"text": doc, "id": rng.getrandbits(32)}) + "\n")
            f.write("".join(lines))


def prefix_copy(src: Path, dst: Path, gigabytes: float) -> None:
    """The first `gigabytes` of src, cut at a line end (smaller corpora are prefixes of the largest)."""
    if dst.exists():
        return
    with open(src, "rb") as f, open(dst, "wb") as g:
        shutil.copyfileobj(_limited(f, int(gigabytes * 1e9)), g, 1 << 24)
        g.write(f.readline())


class _limited:
    def __init__(self, f, n: int):
        self.f, self.left = f, n

    def read(self, size: int = -1) -> bytes:
        data = self.f.read(min(size if size > 0 else self.left, self.left))
        self.left -= len(data)
        return data


# --- measuring ----------------------------------------------------------------------------------------------

def measure(cmd: list[str], env: dict | None = None, until: str | None = None, cwd: Path = REPO) -> dict:
    """Run cmd; wall time, CPU time and peak RSS / PSS of its process tree (optionally: seconds until a line
    containing `until` appears on its stdout, then the process is ended)."""
    import psutil

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    root = psutil.Process(proc.pid)
    peak_rss = peak_pss = 0.0
    text, first_hit, last_sample = b"", None, 0.0
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while True:
        if sel.select(0.5):
            chunk = os.read(proc.stdout.fileno(), 1 << 16)  # raw reads: no line waits in a buffer
            text = (text + chunk)[-20000:]
            if until and first_hit is None and until.encode() in text:
                first_hit = round(time.perf_counter() - start, 2)
                proc.terminate()
            if not chunk and proc.poll() is not None:
                break
        if time.perf_counter() - last_sample >= 0.5:
            last_sample = time.perf_counter()
            rss, pss = _tree_memory(root)
            peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        if proc.poll() is not None and not sel.select(0):
            break
    proc.wait()
    tail = text.decode(errors="replace").splitlines()[-15:]
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"rc": proc.returncode, "wall_s": round(wall, 2), "cpu_s": round(cpu, 1), "peak_rss_mb": round(peak_rss / 1e6),
            "peak_pss_mb": round(peak_pss / 1e6), "load_at_start": round(load, 2), "until_s": first_hit,
            "tail": tail}


def _tree_memory(root) -> tuple[float, float]:
    import psutil
    rss = pss = 0.0
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0, 0.0
    for p in procs:
        try:
            info = p.memory_full_info()
            rss, pss = rss + info.rss, pss + info.pss
        except psutil.Error:
            pass
    return rss, pss


# --- the runners --------------------------------------------------------------------------------------------

def run_prepare(corpus: Path, tok: Path, out: Path, num_proc: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    return measure([PY, "-m", "bigtrain.data.prepare.cli", "--data", str(corpus), "--out", str(out), "--tokenizer",
                    str(tok), "--num-proc", str(num_proc), "--quiet"])


def run_old(corpus: Path, tok: Path, work: Path, commit: str) -> dict:
    old = work / "old_bigtrain"
    if not (old / "bigtrain" / "data").is_dir():
        old.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", commit, "bigtrain/data"], cwd=REPO, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
        (old / "bigtrain" / "__init__.py").write_text("")
    scratch = work / "old_run"
    shutil.rmtree(scratch, ignore_errors=True)
    # cwd = the old copy: `python -c` puts the working directory first on sys.path, before PYTHONPATH
    result = measure([PY, "-c", OLD_PATH, str(corpus), str(tok), str(scratch)], env={"PYTHONPATH": str(old)}, cwd=old)
    shutil.rmtree(scratch, ignore_errors=True)
    return result


def run_nanogpt(corpus: Path, tok: Path, work: Path, num_proc: int) -> dict:
    cache, out = work / "nanogpt_cache", work / "nanogpt.bin"
    shutil.rmtree(cache, ignore_errors=True)
    result = measure([PY, "-c", NANOGPT, str(corpus), str(tok), str(out), str(num_proc), str(cache)],
                     env={"TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_OFFLINE": "1"})
    shutil.rmtree(cache, ignore_errors=True)
    out.unlink(missing_ok=True)
    return result


def run_first_step(prepared: Path, work: Path) -> dict:
    out = work / "first_step_run"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [PY, "bigtrain/run.py", "--data", str(prepared), "--size", "tiny", "--steps", "1", "--out", str(out),
           "--set", "data.seq_len=256", "--set", "precision=fp32", "--set", "logging.progress_bar=false",
           "--set", "train.sample_tokens=0", "--set", "train.eval_interval=1000", "--peak-tflops", "1"]
    result = measure(cmd, env={"OMP_NUM_THREADS": "1"}, until="step 1/1")
    shutil.rmtree(out, ignore_errors=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/bench_prepare"))
    p.add_argument("--sizes", default="0.3,1,3", help="corpus sizes in GB")
    p.add_argument("--runners", default="prepare-1,prepare-2,old,nanogpt-2,first-step",
                   help="which runners (prepare-N, old, nanogpt-N, first-step)")
    p.add_argument("--one-proc-max-gb", type=float, default=1.0, help="prepare-1 only up to this size (it is slow)")
    p.add_argument("--old-max-gb", type=float, default=1.0, help="the old path holds the corpus in RAM: sizes up to")
    p.add_argument("--nanogpt-max-gb", type=float, default=1.0, help="nanogpt-N only up to this size")
    p.add_argument("--old-commit", default="a72be70", help="bigtrain commit whose bigtrain/data is the old path")
    p.add_argument("--clean", action="store_true", help="delete the corpora and outputs at the end")
    args = p.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    sizes = sorted(float(s) for s in args.sizes.split(","))
    results_path = work / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else []

    make_corpus(work / f"corpus-{sizes[-1]:g}GB.jsonl", sizes[-1])
    corpora = {s: work / f"corpus-{s:g}GB.jsonl" for s in sizes}
    for s in sizes[:-1]:
        prefix_copy(corpora[sizes[-1]], corpora[s], s)
    tok = work / "tokenizer"
    if not (tok / "tokenizer.json").is_file():
        from bigtrain.data.tokenizer import ensure_tokenizer
        from pydoc_data.topics import topics
        ensure_tokenizer(tok, lambda: list(topics.values()), 4096)

    def record(runner: str, size: float, result: dict) -> None:
        mb = corpora[size].stat().st_size / 1e6
        result.update(runner=runner, size_gb=size, input_mb=round(mb, 1), mb_per_s=round(mb / result["wall_s"], 3))
        results.append(result)
        results_path.write_text(json.dumps(results, indent=1))
        print(f"{runner:10s} {size:4g} GB: {result['wall_s']:8.1f} s  {result['mb_per_s']:6.2f} MB/s  "
              f"CPU {result['cpu_s']:7.0f} s  peak RSS {result['peak_rss_mb']:6d} MB  PSS {result['peak_pss_mb']:6d} MB"
              f"  load {result['load_at_start']}  rc {result['rc']}", flush=True)
        if result["rc"] != 0:
            print("\n".join(result["tail"]), flush=True)

    runners = args.runners.split(",")
    done = {(r["runner"], r["size_gb"]) for r in results if r["rc"] == 0}  # a rerun measures only what is missing
    for size in sizes:
        for runner in runners:
            if (runner, size) in done:
                continue
            if runner.startswith("prepare-"):
                n = int(runner.split("-")[1])
                if n == 1 and size > args.one_proc_max_gb:
                    continue
                keep = size == sizes[-1] and n == max(int(r.split("-")[1]) for r in runners if r.startswith("prepare-"))
                out = work / f"prepared-{size:g}GB" if keep else work / "prepared-scratch"
                record(runner, size, run_prepare(corpora[size], tok, out, n))
                if not keep:
                    shutil.rmtree(out, ignore_errors=True)
            elif runner == "old" and size <= args.old_max_gb:
                record(runner, size, run_old(corpora[size], tok, work, args.old_commit))
            elif runner.startswith("nanogpt-") and size <= args.nanogpt_max_gb:
                record(runner, size, run_nanogpt(corpora[size], tok, work, int(runner.split("-")[1])))
    if ("first-step" in runners and ("first-step", sizes[-1]) not in done
            and (work / f"prepared-{sizes[-1]:g}GB" / "manifest.json").is_file()):
        result = run_first_step(work / f"prepared-{sizes[-1]:g}GB", work)
        record("first-step", sizes[-1], result)
        print(f"launch to first step on the prepared {sizes[-1]:g} GB corpus: {result['until_s']} s")
    if args.clean:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
