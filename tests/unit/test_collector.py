"""The cycle collector over a training process's start (bigtrain/train/collector.py): paused through the imports and
the set-up, then one collection, the survivors frozen and the collector resumed before the first step."""
from __future__ import annotations

import gc
import weakref

import pytest

from launch import TINY

from bigtrain.train.collector import paused_for_start, settle


@pytest.fixture(autouse=True)
def collector_as_found():
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    gc.enable() if enabled else gc.disable()


class Node:
    pass


def test_paused_until_settled_then_collected_frozen_and_resumed():
    gc.enable()
    with paused_for_start():
        assert not gc.isenabled()
        cycle = Node()
        cycle.me = cycle
        gone = weakref.ref(cycle)
        del cycle
        gc.collect(0)  # an explicit collection still runs; make a fresh cycle the next collection must find
        again = Node()
        again.me = again
        gone_again = weakref.ref(again)
        del again
        assert gone_again() is not None  # nothing collects it while paused
        frozen_before = gc.get_freeze_count()
        settle()
        assert gc.isenabled() and gone() is None and gone_again() is None
        assert gc.get_freeze_count() > frozen_before
    assert gc.isenabled()


def test_a_caller_who_keeps_the_collector_on_or_off_keeps_it():
    gc.enable()
    frozen = gc.get_freeze_count()
    settle()  # on: several jobs in one process, each frozen after its end by its caller
    assert gc.isenabled() and gc.get_freeze_count() == frozen
    gc.disable()
    with paused_for_start():
        pass
    assert not gc.isenabled()
    with pytest.raises(RuntimeError), paused_for_start():
        raise RuntimeError("a refusal ends the start early")
    assert not gc.isenabled()


def test_a_job_started_paused_trains_with_the_collector_on_and_its_start_frozen(one_rank_group, tmp_path,
                                                                                 monkeypatch):
    import bigtrain.train.job as job
    from bigtrain.config.flags import build_run_parser, run_config_from_args
    from bigtrain.distributed.world import World
    seen = []
    loop = job.train_loop

    def recording_loop(*args, **kwargs):
        seen.append((gc.isenabled(), gc.get_freeze_count()))
        return loop(*args, **kwargs)
    monkeypatch.setattr(job, "train_loop", recording_loop)
    args = build_run_parser().parse_args(["--out", str(tmp_path / "run"), *TINY, "--steps", "2"])
    gc.unfreeze()
    with paused_for_start():  # as bigtrain/run.py starts a rank
        job.train(run_config_from_args(args), World(0, 0, 1))
    ((enabled, frozen),) = seen
    assert enabled and frozen > 100_000  # the libraries' objects, out of the loop's collections
