"""The job's spine (bigtrain/train/job.py): the engine gets exactly the dict `bigtrain.ds.resolve` returned,
for the probe's throw-away engines and the job's own, and nothing edits it on the way."""
from __future__ import annotations

import copy

import deepspeed

from launch import TINY

import bigtrain.train.job as job
import bigtrain.train.job_config as job_config
from bigtrain.config.flags import build_run_parser, run_config_from_args


def test_every_engine_gets_exactly_what_resolve_returned(one_rank_group, tmp_path, monkeypatch):
    from bigtrain.distributed.world import World
    resolved, given = [], []
    resolve, initialize = job_config.resolve, deepspeed.initialize

    def recording_resolve(*args, **kwargs):
        result = resolve(*args, **kwargs)
        resolved.append((result, copy.deepcopy(result.ds_config)))
        return result

    def recording_initialize(*args, config, **kwargs):
        given.append(config)
        return initialize(*args, config=config, **kwargs)

    monkeypatch.setattr(job_config, "resolve", recording_resolve)
    monkeypatch.setattr(deepspeed, "initialize", recording_initialize)
    args = build_run_parser().parse_args(["--out", str(tmp_path / "run"), *TINY, "--steps", "2", "--set",
                                      "batch.micro_batch=auto", "--set", "batch.global_batch=8"])
    summary = job.train(run_config_from_args(args), World(0, 0, 1))
    assert len(given) >= 2  # the probe's engine(s), then the job's
    for config in given:
        match = [(r, snapshot) for r, snapshot in resolved if r.ds_config is config]
        assert match, "an engine got a dict that resolve did not return"
        assert config == match[0][1], "the dict changed between resolve and the engine"
    jobs_dict = given[-1]
    assert jobs_dict is resolved[-1][0].ds_config and jobs_dict["train_batch_size"] == 8
    assert summary["ds_config"] == resolved[-1][0].recorded
