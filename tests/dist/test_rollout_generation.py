"""Generation for online RL on DeepSpeed engines (bigtrain/rollout/generate.py), on 1 and 2 ranks, one launch each
(tests/dist_scripts/rollout_generation.py makes the engines with deepspeed.initialize itself): ZeRO-0, ZeRO-3
with the weights gathered once per round, ZeRO-3 left partitioned (the compact decode with the ranks in step, and
DeepSpeed's HybridEngineRollout for objective.decode=generate).

What each assertion would catch: greedy tokens that differ between stages, rank counts or from transformers'
generate on the plain module (padding, position ids, a leaked generation_config, masking after the end-of-text);
log-probs that are not the sampling distribution's; a sampler that does not restart from its seed or its saved
state (a resumed run sampling other completions), or that consumes another mode's stream; and the ZeRO-3 deadlock
of DeepSpeed issue 8262: with 2 ranks, rank 0's prompts end after 2 tokens while rank 1's never end, so a
partitioned rank that stopped at its end-of-text would leave the other waiting in an all-gather (the launch
would time out instead of finishing); and whole weights (ZeRO-0, gathered) decoding every step anyway."""
from __future__ import annotations

import json

import pytest

from launch import REPO, launch_ranks, rank_env

SCRIPT = REPO / "tests" / "dist_scripts" / "rollout_generation.py"
MODES = ("zero0", "zero3_gathered", "zero3_partitioned")


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("rollout")
    found = {}
    for world in (1, 2):
        proc = launch_ranks(SCRIPT, [str(out)], world, env=rank_env(), timeout=420)
        assert proc.returncode == 0, f"{world} ranks failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n" \
                                     f"{proc.stderr[-6000:]}"
        found[world] = json.loads((out / f"world{world}.json").read_text())
    return found


def test_greedy_tokens_equal_across_stages_ranks_and_transformers(reports):
    reference = [r["tokens"] for r in reports[1]["reference"]]
    eos = reports[1]["eos"]
    assert reference[0] == reference[2] == reference[0][:1] + [eos]  # rank 0's prompts end after 2 tokens
    assert all(eos not in reference[i] and len(reference[i]) == 8 for i in (1, 3))  # rank 1's never end
    for world, report in reports.items():
        assert [r["tokens"] for r in report["reference"]] == reference
        for mode in MODES:
            got = report["modes"][mode]
            assert got["greedy"] == reference, (world, mode)
            assert got["truncated"] == [reports[1]["eos"] not in r for r in reference], (world, mode)


def test_log_probs_are_the_sampling_distributions(reports):
    for world, report in reports.items():
        for mode in MODES:
            for ours, theirs in zip(report["modes"][mode]["logps"], report["reference"]):
                assert ours == pytest.approx(theirs["logps"], abs=1e-5), (world, mode)


def test_sampling_restarts_from_its_seed_and_its_saved_state(reports):
    for world, report in reports.items():
        zero0 = report["modes"]["zero0"]["sampled"]
        for mode in MODES:
            sampled = report["modes"][mode]["sampled"]
            assert sampled["again"] == sampled["first"], (world, mode)
            assert sampled["second_restored"] == sampled["second"], (world, mode)
            assert sampled["second"] != sampled["first"], (world, mode)  # the stream moved on
            assert all(a != b for a, b in sampled["first"]), (world, mode)  # a prompt's 2 completions differ
            # one stream, whatever the stage or mode, per decoding: compact (partitioned: the ranks in step, a rank
            # whose completions ended decoding a placeholder that draws nothing) and generate's (partitioned:
            # DeepSpeed's HybridEngineRollout, every row to max_new_tokens)
            assert sampled["first_padded"] == zero0["first_padded"], (world, mode)
            assert sampled["first"] == zero0["first"], (world, mode)



def test_partitioned_ranks_decode_alike_and_whole_weights_stop_early(reports):
    """Forward calls per rank in the greedy round: max_new_tokens (8) decode steps + 1 for the log-probs where
    the weights stay partitioned; where they are whole, a rank whose completions all ended stops (rank 0: 2)."""
    assert reports[2]["modes"]["zero3_partitioned"]["forwards"] == [9, 9]
    for mode in ("zero0", "zero3_gathered"):
        assert reports[2]["modes"][mode]["forwards"] == [3, 9], mode
    assert reports[1]["modes"]["zero3_gathered"]["forwards"] == [9]
