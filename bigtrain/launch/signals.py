"""A stop request passed from `bigtrain train` to its ranks, and the wait for them to end.

DeepSpeed's single-node runner dies on SIGTERM without telling its ranks, and its per-node launcher
(`deepspeed.launcher.launch`), signalled itself, gives them 30 s and then SIGKILLs them
(`terminate_process_tree`): a step and its checkpoint longer than that were cut short without a word, inside
bigtrain's own grace (`Lifeline`, 50 s). So the signal goes to the ranks alone where that launcher runs here; they
save and exit, and the launchers end with them. Elsewhere (ranks on other nodes behind pdsh, or before the ranks
exist) the launch's whole session gets it. Either way `bigtrain train` returns only once no process of the
session is left, so that a `--resume` run at its return never races a rank still writing a checkpoint.
"""
from __future__ import annotations

import os
import sys
import time

from bigtrain.distributed.lifeline import AGENTS, stop_grace_s

POLL_S = 0.2
AFTER_GRACE_S = 30.0  # a rank past its grace ends itself with a line; this is for one that could not


def pass_signal(session: int, signum: int) -> None:
    """Send `signum` to the ranks under the launcher session `session` (the runner's or the per-node launcher's
    pid), else the whole session."""
    ranks = local_ranks(session)
    if not ranks:
        _signal_session(session, signum)
        return
    import psutil
    for rank in ranks:
        try:
            rank.send_signal(signum)
        except psutil.Error:
            pass  # ended meanwhile


def local_ranks(runner: int) -> list:
    """The psutil processes of the ranks that a per-node launcher at or under `runner` started on this machine."""
    import psutil
    try:
        root = psutil.Process(runner)
        tree = [root, *root.children(recursive=True)]  # bigtrain starts the per-node launcher itself on one machine
    except psutil.Error:
        return []
    agents = []
    for proc in tree:
        try:
            if any(agent in " ".join(proc.cmdline()) for agent in AGENTS):
                agents.append(proc)
        except psutil.Error:
            continue
    pids = {agent.pid for agent in agents}
    ranks = []
    for agent in agents:
        try:
            ranks += [child for child in agent.children() if child.pid not in pids]
        except psutil.Error:
            continue
    return ranks


def wait_for_session(session: int) -> None:
    """Return once no process of `session` is left; past the ranks' grace and a margin, end what remains with
    SIGKILL and say so (a rank that could not end itself: its last checkpoint is the one to resume)."""
    deadline = time.monotonic() + stop_grace_s() + AFTER_GRACE_S
    while _session_alive(session):
        if time.monotonic() > deadline:
            print(f"bigtrain: ranks of the launch still ran {stop_grace_s() + AFTER_GRACE_S:.0f} s after its launcher "
                  "ended: killed them; resume from the last complete checkpoint with --resume", file=sys.stderr,
                  flush=True)
            _signal_session(session, 9)
            return
        time.sleep(POLL_S)


def _session_alive(session: int) -> bool:
    try:
        os.killpg(session, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _signal_session(session: int, signum: int) -> None:
    try:
        os.killpg(session, signum)
    except ProcessLookupError:
        pass
