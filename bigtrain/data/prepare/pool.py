"""A small pool of worker processes for prepare, talking JSON lines over pipes.

Why not multiprocessing: its "spawn" start re-runs the caller's main script in every worker
(a user's script without an `if __name__ == "__main__":` guard would recurse), and "fork"
from a training rank copies torch, gloo threads and their locks. Here each worker is a
fresh `python -m bigtrain.data.prepare.worker` that imports only numpy and `tokenizers`,
runs one thread, dies with its parent, and reports progress after every batch.
"""
from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import bigtrain
from bigtrain.data.prepare.pieces import Piece


class WorkerPool:
    """`n` workers that each tokenize one piece at a time; `poll` hands back progress and results."""

    def __init__(self, n: int, init: dict[str, Any]):
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(Path(bigtrain.__file__).resolve().parents[1]),
                                               os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        self.procs = [subprocess.Popen([sys.executable, "-m", "bigtrain.data.prepare.worker"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, env=env, bufsize=0) for _ in range(n)]
        self.busy: dict[int, Piece] = {}  # worker number -> its piece
        self.pending = [b""] * n  # bytes read from a worker after its last full line
        self.selector = selectors.DefaultSelector()
        for i, proc in enumerate(self.procs):
            self.selector.register(proc.stdout, selectors.EVENT_READ, i)
            self._send(i, {"init": init})

    @property
    def idle(self) -> int:
        return len(self.procs) - len(self.busy)

    def submit(self, piece: Piece, text_field: str | tuple[str, ...], shard_dir: str) -> None:
        worker = next(i for i in range(len(self.procs)) if i not in self.busy)
        self.busy[worker] = piece
        self._send(worker, {"piece": asdict(piece), "text_field": text_field, "shard_dir": shard_dir})

    def poll(self, timeout: float, on_progress: Callable[[list[int]], None],
             on_done: Callable[[Piece, dict], None]) -> None:
        """Wait up to `timeout` s; progress deltas [tokens, docs, bytes] and finished pieces go to the callbacks."""
        for key, _ in self.selector.select(timeout):
            for message in self._messages(key.data):
                self._handle(key.data, message, on_progress, on_done)

    def _messages(self, worker: int) -> list[dict]:
        data = os.read(self.procs[worker].stdout.fileno(), 1 << 16)  # raw: no line left behind in a buffer
        if not data:
            self._died(worker)
        *lines, self.pending[worker] = (self.pending[worker] + data).split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]

    def _handle(self, worker: int, message: dict, on_progress: Callable[[list[int]], None],
                on_done: Callable[[Piece, dict], None]) -> None:
        if "progress" in message:
            on_progress(message["progress"])
        elif "error" in message:
            if message.get("user"):
                raise ValueError(message["error"])
            raise RuntimeError(f"prepare worker failed on piece {self.busy.get(worker)}:\n{message['error']}")
        elif "done" in message:
            on_done(self.busy.pop(worker), message["done"])

    def _send(self, worker: int, message: dict) -> None:
        try:
            self.procs[worker].stdin.write((json.dumps(message) + "\n").encode())
        except BrokenPipeError:
            self._died(worker)

    def _died(self, worker: int) -> None:
        code = self.procs[worker].wait()
        raise RuntimeError(f"a prepare worker died (exit code {code}: killed, or out of memory?) on piece "
                           f"{self.busy.get(worker)}; run the same command again to resume from the finished shards")

    def close(self) -> None:
        """Ask idle workers to leave; kill busy ones (after an error or an interrupt)."""
        for i, proc in enumerate(self.procs):
            if proc.poll() is None:
                if i in self.busy:
                    proc.kill()
                else:
                    try:
                        proc.stdin.close()
                    except OSError:
                        proc.kill()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()
        self.selector.close()
