"""The cycle collector over a training process's start (bigtrain/train/collector.py): paused through the imports and
the set-up, then one collection, the survivors frozen and the collector resumed before the first step."""
from __future__ import annotations

import gc
import weakref

import pytest

from launch import TINY

from bigtrain.train.collector import keep_libraries, paused_for_start, settle


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


def test_the_libraries_frozen_early_and_what_comes_after_still_collected():
    gc.enable()
    with paused_for_start():
        keep_libraries()
        frozen = gc.get_freeze_count()
        assert frozen > 0 and not gc.isenabled()  # still paused: the set-up goes on
        cycle = Node()
        cycle.me = cycle
        gone = weakref.ref(cycle)
        del cycle
        settle()
        assert gone() is None and gc.isenabled()
    gc.enable()
    before = gc.get_freeze_count()
    keep_libraries()  # a caller with the collector on is left alone
    assert gc.get_freeze_count() == before


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
    seen, built = [], []
    loop, build = job.train_loop, job.build_model

    def recording_build(*args, **kwargs):  # the libraries (the model's family with them) frozen by now
        cycle = Node()
        cycle.me = cycle
        built.append((gc.isenabled(), gc.get_freeze_count(), weakref.ref(cycle)))
        return build(*args, **kwargs)

    def recording_loop(*args, **kwargs):
        seen.append((gc.isenabled(), gc.get_freeze_count()))
        return loop(*args, **kwargs)
    monkeypatch.setattr(job, "train_loop", recording_loop)
    monkeypatch.setattr(job, "build_model", recording_build)
    args = build_run_parser().parse_args(["--out", str(tmp_path / "run"), *TINY, "--steps", "2"])
    gc.unfreeze()
    with paused_for_start():  # as bigtrain/run.py starts a rank
        job.train(run_config_from_args(args), World(0, 0, 1))
    ((enabled, frozen),) = seen
    assert enabled and frozen > 100_000  # the libraries' objects, out of the loop's collections
    ((enabled_at_build, frozen_at_build, cycle),) = built
    assert not enabled_at_build and frozen_at_build > 100_000  # out of the first collection's walk too
    assert cycle() is None  # the set-up's own garbage was collected before the first step
