"""bigtrain.parallel: topology checks, activation checkpointing from outside the model, the
pipeline form under DeepSpeed (2 stages, tied embedding), and GPT-2 built inside zero.Init."""
from __future__ import annotations

import copy
import json
import pathlib
import subprocess

import pytest
import torch
from launch import rank_env, torchrun_cmd

from bigtrain.models import build
from bigtrain.parallel import apply_activation_checkpointing, check_topology, to_pipeline_module
from bigtrain.parallel.pipeline import layer_specs

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "dist_scripts"


def launch(script: str, *args: str, timeout: int = 240) -> None:
    """Two real ranks through torchrun; fail with the tail of its output."""
    proc = subprocess.run(torchrun_cmd(SCRIPTS / script, list(args)), cwd=ROOT, env=rank_env(PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


def read_ranks(out: pathlib.Path) -> list[dict]:
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in reports] == [0, 1]
    return reports


@pytest.mark.parametrize("args, message", [
    ((4, 3, 10), "world size 4 is not divisible by pipeline.stages=3"),
    ((4, 4, 3), "pipeline.stages=4 exceeds the model's 3 pipeline layers"),
    ((0, 1, 3), "must both be >= 1"),
])
def test_check_topology_rejects_impossible_layouts(args, message):
    with pytest.raises(ValueError, match=message):
        check_topology(*args)


def test_check_topology_returns_data_parallel_size():
    assert check_topology(8, 2, 10) == 4
    assert check_topology(2, 1, 1) == 2


def test_pipeline_arguments_are_checked_before_building():
    spec = build("gpt2", "tiny", vocab_size=256)
    with pytest.raises(ValueError, match="partition_method='layers': use 'parameters', 'uniform' or 'type:REGEX'"):
        to_pipeline_module(spec, 2, partition_method="layers")
    with pytest.raises(ValueError, match="activation_checkpoint_interval=-1"):
        to_pipeline_module(spec, 2, activation_checkpoint_interval=-1)


def test_layer_specs_tie_embedding_and_head_and_start_from_the_plain_weights():
    spec = build("gpt2", "tiny", vocab_size=256)
    specs = layer_specs(spec, spec.layers(), seed=5)
    tied = [s for s in specs if hasattr(s, "key")]
    assert [s.key for s in tied] == ["wte", "wte"] and tied[0].forward_fn is None and tied[1].forward_fn is not None
    # Whichever stage builds a layer (the head's stage builds the tied embedding too), it holds the
    # weights the plain module has under the same names for the same seed.
    plain = spec.build(seed=5).state_dict()
    block, head = specs[2].build(), tied[1].build()
    assert all(torch.equal(t, plain[f"transformer.h.0.{n}"]) for n, t in block.state_dict().items())
    assert torch.equal(head.weight, plain["transformer.wte.weight"])


CHECKPOINT_CASES = [
    ("gpt2", {"vocab_size": 256, "dropout": 0.1, "n_layer": 4}, "deepspeed", 1, 4),
    ("gpt2", {"vocab_size": 256, "dropout": 0.1, "n_layer": 4}, "native", 1, 4),
    ("gpt2", {"vocab_size": 256, "dropout": 0.1, "n_layer": 4}, "auto", 2, 2),
    ("encoder", {"vocab_size": 256, "n_positions": 32, "dropout": 0.1}, "auto", 1, 2),
    ("resnet", {}, "deepspeed", 1, 4),
    ("resnet", {}, "auto", 3, 2),
]


@pytest.mark.parametrize("family, overrides, method, every_n, blocks", CHECKPOINT_CASES)
def test_activation_checkpointing_leaves_gradients_unchanged(family, overrides, method, every_n, blocks):
    """deepspeed.checkpointing unconfigured (its defaults) or HF's own, with dropout on."""
    spec = build(family, "tiny", **overrides)
    torch.manual_seed(0)
    plain = spec.build().train()
    wrapped = copy.deepcopy(plain)
    assert apply_activation_checkpointing(spec, wrapped, every_n=every_n, method=method) == blocks
    gen = torch.Generator().manual_seed(2)
    if spec.modality == "image":
        inputs, labels = torch.randn(2, 3, 32, 32, generator=gen), torch.tensor([3, 5])
    else:
        inputs = torch.randint(0, 256, (2, 16), generator=gen)
        labels = inputs if family == "gpt2" else torch.tensor([0, 1])
    results = []
    for module in (plain, wrapped):
        torch.manual_seed(1)  # same dropout masks
        loss = spec.loss(module(inputs), labels)
        loss.backward()
        results.append((loss.item(), dict(module.named_parameters()), dict(module.named_buffers())))
    (loss_a, params_a, bufs_a), (loss_b, params_b, bufs_b) = results
    assert loss_a > 0.1 and abs(loss_a - loss_b) <= 1e-6
    for name, p in params_a.items():
        torch.testing.assert_close(params_b[name].grad, p.grad, rtol=0, atol=1e-6, msg=name)
    for name, buf in bufs_a.items():  # BatchNorm stats moved once, not again in the recompute
        assert torch.equal(bufs_b[name], buf), name
    assert set(wrapped.state_dict()) == set(plain.state_dict())


def test_activation_checkpointing_bad_arguments():
    spec = build("resnet", "tiny")
    with pytest.raises(ValueError, match="resnet has no native activation checkpointing"):
        apply_activation_checkpointing(spec, spec.build(), method="native")
    with pytest.raises(ValueError, match="method='fast': use one of auto, native, deepspeed"):
        apply_activation_checkpointing(spec, spec.build(), method="fast")
    with pytest.raises(ValueError, match="every_n=0"):
        apply_activation_checkpointing(spec, spec.build(), every_n=0)


@pytest.fixture(scope="module")
def dist_reports(tmp_path_factory) -> list[dict]:
    """One 2-rank launch of tests/dist_scripts/models_dist_checks.py; its per-rank reports."""
    out = tmp_path_factory.mktemp("models_dist")
    launch("models_dist_checks.py", str(out))
    return read_ranks(out)


@pytest.mark.dist
def test_activation_checkpointing_with_configured_deepspeed(dist_reports):
    """`deepspeed.checkpointing.configure`d from a DeepSpeed config (partitioned activations on CPU)."""
    for rank_report in dist_reports:
        report = rank_report["checkpointing"]
        assert sorted(report) == ["encoder", "gpt2", "resnet"]
        for family, r in report.items():
            assert r["partition_activations"] and r["blocks"] >= 2 and r["loss"] > 0.1, family
            assert r["loss_diff"] <= 1e-6 and r["grad_diff"] <= 1e-6 and r["buffer_diff"] == 0.0, (family, r)


@pytest.mark.dist
def test_two_stage_pipeline_matches_plain_gpt2_and_keeps_embedding_tied(dist_reports):
    reports = [r["pipeline"] for r in dist_reports]
    for rank, report in enumerate(reports):
        for interval, run in report["runs"].items():
            assert run["stage"] == rank and run["parts"] == [0, 4, 8]
            # Same loss as the plain module on the same two micro-batches ...
            assert abs(run["eval_loss"] - report["reference_loss"]) <= 1e-6
            assert abs(run["train_loss"] - report["reference_loss"]) <= 1e-6
            # ... and after one SGD step every weight this stage holds equals the plain
            # module's; the tied embedding, on both stages, moved by the gradient of both uses.
            assert run["has_tied_wte"] and {"transformer.wte.weight", "lm_head.weight"} <= set(run["names"])
            assert run["max_weight_diff"] <= 1e-6 and run["start_diff"] > 1e-3
            assert run["checkpointed_segments"] == (2 if interval == "1" else 0)
    assert "transformer.wpe.weight" in reports[0]["runs"]["0"]["names"]
    assert "transformer.ln_f.weight" in reports[1]["runs"]["0"]["names"]


@pytest.mark.dist
def test_zero3_init_builds_gpt2_partitioned_across_two_ranks(dist_reports):
    reports = [r["zero3"] for r in dist_reports]
    for kind in ("fresh", "pretrained"):
        per_rank = [r[kind] for r in reports]
        for r in per_rank:
            total = r["total_numel"]
            assert total == reports[0]["num_params"]  # all parameters, tied ones once
            # Each rank holds half (shards are padded by at most one element per tensor).
            assert total / 2 <= r["local_numel"] <= total / 2 + r["num_tensors"]
            assert r["max_local_param_numel"] == 0  # no rank ever held a full tensor after init
            assert r["tied"]
            assert abs(r["wte_std"] - 0.02) < 0.001  # transformers' init ran on the gathered shards
            assert abs(r["c_proj_std"] - 0.02 / 2) < 0.001  # incl. the 1/sqrt(2L) residual scaling
        assert per_rank[0]["checksum"] == per_rank[1]["checksum"]  # both ranks see one model
    for r in reports:
        loaded = r["pretrained"]
        assert loaded["max_abs_diff_vs_saved"] == 0.0
        assert abs(loaded["engine_loss"] - loaded["reference_loss"]) <= 1e-6
        # Activation checkpointing around ZeRO-3 blocks: same losses, the 2nd after an AdamW step.
        plain, ckpt = loaded["train_losses"], loaded["train_losses_checkpointed"]
        assert plain[1] < plain[0] and max(abs(a - b) for a, b in zip(plain, ckpt)) <= 1e-5
