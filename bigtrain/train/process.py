"""One training process: the process group, the console, and how the job ends.

    with JobProcess.start() as job:
        train(run, job.world, ..., lifeline=job.lifeline)
    return job.code

Exit codes: 0 done; 2 a user's mistake (one line from rank 0, whichever rank saw it: `JobStop.end`);
3 a diverging run (`Diverged`). Any other exception on a multi-rank job ends this rank with exit 1 and a
line naming the dead peer, or this rank if it is the origin. Never hangs: SIGTERM/SIGINT or the launcher's
death stop the job within a bound (`Lifeline`), and so does an end-of-run step that waits too long.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from bigtrain.distributed.lifeline import Lifeline
from bigtrain.distributed.job_stop import JobStop
from bigtrain.distributed.peer_watch import PeerWatch
from bigtrain.distributed.peers import PeerStore, gather_peers
from bigtrain.distributed.world import World, collective_timeout_s, init_distributed, shutdown
from bigtrain.ds.lint import LintError
from bigtrain.train.loop import Diverged

PACKAGE_DIR = Path(__file__).resolve().parents[1]


@dataclass
class JobProcess:
    world: World
    lifeline: Lifeline
    watch: PeerWatch
    stop: JobStop
    code: int = 0

    @classmethod
    def start(cls) -> "JobProcess":
        """Join the process group (or make a world of one), route the console, start the watchers."""
        world = init_distributed()
        setup_logging(world)
        lifeline = Lifeline.start(world.rank)
        peers, store = gather_peers(world), PeerStore.of(world)
        stop = JobStop(world, peers, store)  # a stop on purpose: one line from rank 0, whichever rank saw it
        watch = PeerWatch.start(world, peers, store, stop)  # a dead peer ends this rank with a line naming it
        lifeline.before_stop = watch.end_if_a_peer_is_lost
        if world.is_main and world.size > 1:
            import logging
            logging.getLogger("bigtrain").info("%s", watch.describe())
        return cls(world, lifeline, watch, stop)

    def __enter__(self) -> "JobProcess":
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> bool:
        if err is None:
            self.watch.leave()  # before the last barrier: a peer past it may exit at once
            with self.lifeline.bound("the last barrier before exit", end_of_run_bound_s(),
                                     "every rank to finish its run"):
                shutdown()
            self.lifeline.close()
            return False
        if isinstance(err, Diverged):
            self.code = self.stop.end(str(err), Diverged.code)
            return True
        if isinstance(err, ValueError) and users_mistake(err):
            self.code = self.stop.end(str(err), 2)
            return True
        if self.world.size > 1 and isinstance(err, Exception):
            self.watch.fail(err)  # names the dead peer or this rank, and exits
        return False


def end_of_run_bound_s() -> float:
    """How long an end-of-run step may take: the collective timeout, plus a minute for the work itself."""
    return collective_timeout_s() + 60.0


def users_mistake(err: Exception) -> bool:
    """A lint error, or a ValueError bigtrain raised about the user's config or data (deterministic: every
    rank raises the same, and one line says what to change). A ValueError from inside a library is a
    failure whose traceback the user needs."""
    if isinstance(err, LintError):
        return True
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(PACKAGE_DIR)


def setup_logging(world: World) -> None:
    from bigtrain.metrics.logs import setup_console
    setup_console(world.rank, world.is_main)  # rank 0's INFO and every rank's warnings on the console
