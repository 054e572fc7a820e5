"""Progress of a prepare: a tqdm bar (MB, MB/s, documents, tokens) on a terminal, a log line otherwise.

Workers report (tokens, documents, input bytes) after every batch, so the bar moves within a
piece; shards kept from an interrupted run count as done at the start but not toward the rate.
"""
from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("bigtrain")
LOG_EVERY_S = 30.0


class Progress:
    def __init__(self, total_bytes: int | None, show: bool):
        self.live = [0, 0, 0]  # reported by pieces in progress: tokens, docs, bytes
        self.done = [0, 0, 0]  # finished pieces
        self.resumed_bytes = 0
        self.started = time.perf_counter()
        self.last_log = self.started
        self.show = show
        self.bar = None
        if show and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1000, desc="prepare",
                            dynamic_ncols=True, file=sys.stderr)

    def add(self, counts: list[int]) -> None:
        """A batch of a piece in progress: [tokens, docs, input bytes]."""
        self.live = [a + b for a, b in zip(self.live, counts)]

    def finished(self, marker: dict, resumed: bool = False) -> None:
        """A piece is done (its batches were reported), or was done before this run."""
        counts = [marker["tokens"], marker["docs"], marker["bytes"]]
        self.done = [a + b for a, b in zip(self.done, counts)]
        if resumed:
            self.resumed_bytes += marker["bytes"]
        else:
            self.live = [a - b for a, b in zip(self.live, counts)]
        self.refresh()

    def totals(self) -> tuple[int, int, int]:
        return self.done[0] + self.live[0], self.done[1] + self.live[1], self.done[2] + self.live[2]

    def refresh(self) -> None:
        tokens, docs, nbytes = self.totals()
        now = time.perf_counter()
        rate = (nbytes - self.resumed_bytes) / max(now - self.started, 1e-9) / 1e6
        if self.bar is not None:
            self.bar.n = nbytes
            self.bar.set_postfix_str(f"{docs:,} docs, {tokens:,} tokens", refresh=False)
            self.bar.refresh()
        elif self.show and now - self.last_log >= LOG_EVERY_S:
            self.last_log = now
            log.info("prepare: %.1f MB read (%.2f MB/s), %s documents, %s tokens", nbytes / 1e6, rate,
                     f"{docs:,}", f"{tokens:,}")

    def close(self) -> None:
        if self.bar is not None:
            self.refresh()
            self.bar.close()
