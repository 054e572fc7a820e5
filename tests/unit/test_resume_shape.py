"""Resuming at another shape, without ranks: which shape changes need a universal-checkpoint conversion or are
refused, the shape read from a checkpoint's marker and from a job's config, and the sampler's premise that
steps after a resume at another data-parallel size take the uninterrupted run's samples (the resumes of real
runs: tests/dist/test_reshape_resume.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

SPLIT = 5  # the step tests/dist/test_reshape_resume.py saves at


@pytest.mark.parametrize("saved, current, expected", [
    ((2, 2, 1), (2, 2, 1), False),
    ((2, 2, 1, "none"), (2, 2, 1, "cpu"), True),  # another optimizer class: native loading fails
    ((2, 3, 1, "nvme"), (2, 3, 1, "nvme"), False),
    ((2, 3, 1, "nvme"), (1, 3, 1, "nvme"), "NVMe"),
    ((2, 2, 1), (1, 3, 1, "nvme"), "NVMe"),
    ((2, 2, 1), (1, 2, 1), True),
    ((2, 2, 1), (2, 3, 1), True),
    ((2, 3, 1), (4, 1, 1), True),
    ((2, 0, 1), (1, 0, 1), False),  # ZeRO-0 keeps the whole optimizer state in one file
    ((2, 0, 1), (2, 2, 1), "saved with ZeRO-0"),
    ((2, 2, 1), (2, 0, 1), "only into ZeRO stages 1-3"),
    ((2, 1, 2), (1, 1, 1), "pipeline checkpoints only at the shape"),
    ((2, 1, 1), (2, 1, 2), "pipeline checkpoints only at the shape"),
])
def test_which_shape_changes_need_or_refuse_a_conversion(saved, current, expected):
    from bigtrain.checkpoint.resume import Shape, needs_universal

    if isinstance(expected, bool):
        assert needs_universal(Shape(*saved), Shape(*current), Path("ckpt/step_000005")) is expected
    else:
        with pytest.raises(ValueError, match=expected):
            needs_universal(Shape(*saved), Shape(*current), Path("ckpt/step_000005"))


def test_shape_reads_the_checkpoint_marker_and_the_job_config():
    from bigtrain.checkpoint.state import CheckpointState
    from bigtrain.checkpoint.resume import Shape
    from bigtrain.config.load import load_run_config
    from bigtrain.ds.resolve import resolve

    state = CheckpointState(step=5, world_size=2, ds_config={"zero_optimization": {"stage": 2}})
    assert Shape.of_checkpoint(state) == Shape(2, 2, 1, "none")
    offloaded = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    assert Shape.of_job(2, offloaded, 1) == Shape(2, 2, 1, "cpu")
    assert str(Shape(2, 2, 1)) == "world size 2 / ZeRO-2"
    assert str(Shape(4, 1, 2)) == "world size 4 / ZeRO-1 / 2 pipeline stages"
    assert str(Shape(1, 3, 1, "cpu")) == "world size 1 / ZeRO-3 / optimizer offload cpu"
    config = {"zero_optimization": {"stage": 3}}
    assert Shape.of_job(1, config, 1) == Shape(1, 3, 1)
    run = load_run_config(None, ["zero.stage=3", "precision=fp32"])
    resolved = resolve(run, None, 1, load_universal=True)  # the engine's dict loads a universal checkpoint once
    assert resolved.ds_config["checkpoint"] == {"load_universal": True} and "checkpoint" not in resolved.recorded
    assert resolved.recorded == resolve(run, None, 1).ds_config


def test_resumed_steps_see_the_same_samples_at_another_data_parallel_size():
    """Saved after 5 steps of 8 samples at dp 2; steps 6.. at dp 1 take the uninterrupted run's samples."""
    from bigtrain.data.sampler import ResumableSampler

    def take(samplers: list, per_rank: int) -> set[int]:
        streams = [iter(s) for s in samplers]
        return {next(it) for it in streams for _ in range(per_rank)}

    two = [ResumableSampler(1000, r, 2, seed=3) for r in range(2)]
    uninterrupted = [take(two, 4) for _ in range(SPLIT + 4)]
    before = [ResumableSampler(1000, r, 2, seed=3) for r in range(2)]
    for _ in range(SPLIT):
        take(before, 4)
    one = ResumableSampler(1000, 0, 1, seed=3)
    one.load_state_dict(before[0].state_dict())
    resumed = [take([one], 8) for _ in range(4)]
    assert resumed == uninterrupted[SPLIT:]
