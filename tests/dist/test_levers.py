"""DeepSpeed's 0.17-0.19 levers through bigtrain, each against one process or another ZeRO stage on the
same batches, fp32, 2-4 CPU ranks:

- Muon (optimizer.name=muon) at ZeRO 1-3: equal curves; at ZeRO 0-3 without clipping: equal curves (DeepSpeed
  clips Muon's update at ZeRO 1-3 and the raw gradient at ZeRO-0, so ZeRO-0 with clipping is refused).
- ZeRO++ hpZ (zero.hpz_partition_size) runs on CPU and matches ZeRO-3 without it; the quantized collectives are
  refused in one line (no quantizer kernel on the CPU).
- ALST's tiled MLP with data and sequence parallelism (ZeRO 2 and 3) and with activation checkpointing, against
  one process.
- Expert parallelism (AutoEP) for Mixtral / Qwen2-MoE / Qwen3-MoE at ZeRO 2 and 3 against one process, EP2 x DP2 on
  4 ranks, mixtures of experts at ZeRO 0-2 without EP, resume at the same shape and at 4 ranks (universal), another
  expert size refused in one line, and the export's whole experts against a run without EP.

Top-2 routing turns the ~1e-7 differences of another reduction order into other expert choices for a few tokens by
step 4, so mixtures of experts are compared over their first MOE_STEPS steps (tests/dist/test_parallel_modes.py).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launch import PRETRAINING_RATE, launch_jobs, summary
from local_moe import MOE, make_moe_dirs

RTOL = 1e-5
STEPS, MOE_STEPS = 4, 3
COMMON = ["--set", "precision=fp32", "--set", "logging.progress_bar=false", "--set", "train.sample_tokens=0",
          "--peak-tflops", "1", "--steps", str(STEPS), "--set", "train.eval_interval=0",
          "--set", "batch.global_batch=8"]
LLAMA = ["--model", "llama", "--size", "tiny", "--set", "data.vocab_size=512", "--set", "data.seq_len=64", *COMMON,
         "--set", "batch.micro_batch=4", "--set", "checkpoint.at_end=false"]
MUON = [*LLAMA, "--set", "optimizer.name=muon"]


def zero(stage: int) -> list[str]:
    return ["--set", f"zero.stage={stage}"]


def job(name: str, args: list[str], *extra: str, **more) -> dict:
    return {"name": name, "args": [*args, *extra], **more}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("levers")
    dirs = make_moe_dirs(root / "moe_dirs")
    moe = {m: ["--model", "hf", "--set", f"model.pretrained={dirs[m]}", "--set", "data.seq_len=32", *COMMON,
               *PRETRAINING_RATE]
           for m in MOE}
    micro = lambda n: ["--set", f"batch.micro_batch={n}"]  # noqa: E731
    ep2 = ["--set", "parallel.expert=2"]
    # a checkpoint only where a test reads one: the exports (mixtral_ep2_z2, mixtral_z2) and the resumes (ep_stop)
    unsaved = ["--set", "checkpoint.at_end=false"]
    launch_jobs(root, [job(f"ref_{m}", moe[m], *micro(4), *unsaved) for m in MOE]
                + [job("ref_llama", LLAMA)], num_ranks=1, name="refs")
    two = [job(f"muon_z{s}", MUON, *zero(s)) for s in (1, 2, 3)]
    two += [job(f"muon_z{s}_noclip", MUON, *zero(s), "--set", "optimizer.grad_clip=0") for s in (0, 3)]
    two += [job("z3", LLAMA, *zero(3)), job("z3_hpz2", LLAMA, *zero(3), "--set", "zero.hpz_partition_size=2"),
            job("z3_qwz", LLAMA, *zero(3), "--set", "zero.quantized_weights=true", expect_error=True)]
    tiled = ["--set", "activation_checkpointing.tiled_mlp=true"]
    two += [job("tiled_z2", LLAMA, *zero(2), *tiled),
            job("sp2_tiled_z3", LLAMA, *zero(3), *tiled, "--set", "parallel.sequence=2"),
            job("sp2_tiled_ckpt", LLAMA, *zero(1), *tiled, "--set", "parallel.sequence=2", "--set",
                "activation_checkpointing.enabled=true")]
    saved = {"mixtral_ep2_z2", "mixtral_z2"}
    two += [job(f"{m}_ep2_z{s}", moe[m], *micro(4), *zero(s), *ep2, *([] if f"{m}_ep2_z{s}" in saved else unsaved))
            for m in MOE for s in (2, 3)]
    two += [job(f"{m}_z{s}", moe[m], *micro(4), *zero(s), *([] if f"{m}_z{s}" in saved else unsaved)) for m, s in
            (("mixtral", 0), ("mixtral", 1), ("mixtral", 2), ("qwen2_moe", 0), ("qwen3_moe", 1))]
    two += [job("ep_stop", moe["mixtral"], *micro(4), *zero(2), *ep2, "--stop-after", "2"),
            job("ep_again", moe["mixtral"], *micro(4), *zero(2), *ep2, "--resume", *unsaved, copy_from="ep_stop"),
            job("ep_to_none", moe["mixtral"], *micro(4), *zero(2), "--resume", copy_from="ep_stop",
                expect_error=True)]
    launch_jobs(root, two, num_ranks=2, name="two", timeout=900)
    launch_jobs(root, [job("mixtral_ep2_dp2", moe["mixtral"], *micro(2), *zero(2), *ep2, "--set",
                           "checkpoint.at_end=false"),
                       job("ep_to4", moe["mixtral"], *micro(2), *zero(2), *ep2, "--resume", *unsaved,
                           copy_from="ep_stop"),
                       job("z3_w4", LLAMA, *zero(3), *micro(2)),
                       job("z3_hpz2_w4", LLAMA, *zero(3), *micro(2), "--set", "zero.hpz_partition_size=2")],
                num_ranks=4, name="four", timeout=900)
    return root


def worst(reference: list[float], losses: list[float], steps: int) -> float:
    return max(abs(a - b) / abs(a) for a, b in list(zip(reference, losses))[:steps])


@pytest.mark.parametrize("name, reference", [("muon_z2", "muon_z1"), ("muon_z3", "muon_z1"),
                                             ("muon_z0_noclip", "muon_z3_noclip")])
def test_muon_trains_alike_at_every_zero_stage(runs, name, reference):
    ran, ref = summary(runs / name), summary(runs / reference)
    assert ran["ds_config"]["optimizer"]["type"] == "Muon" and len(ran["losses"]) == STEPS
    margin = worst(ref["losses"], ran["losses"], STEPS)
    print(f"{name} vs {reference}: {margin:.2e}")
    assert margin <= RTOL
    assert ran["losses"][-1] < ran["losses"][0]  # it trains
    assert summary(runs / "muon_z1")["losses"] != summary(runs / "z3")["losses"]  # and is not AdamW


@pytest.mark.parametrize("name, reference", [("z3_hpz2", "z3"), ("z3_hpz2_w4", "z3_w4")])
def test_hpz_runs_on_cpu_and_matches_zero3(runs, name, reference):
    """hpZ 2 on 2 ranks (the whole world) and on 4 (two secondary groups of 2) against ZeRO-3 without it."""
    ran, ref = summary(runs / name), summary(runs / reference)
    assert ran["ds_config"]["zero_optimization"]["zero_hpz_partition_size"] == 2
    assert worst(ref["losses"], ran["losses"], STEPS) <= RTOL


def test_quantized_collectives_are_refused_on_cpu_in_one_line(runs):
    said = (runs / "z3_qwz" / "error.txt").read_text()
    assert "zero_optimization.zero_quantized_weights=true needs DeepSpeed's quantizer kernel" in said, said
    assert "\n" not in said.strip()


@pytest.mark.parametrize("name, reference", [
    *[(f"{m}_ep2_z{s}", f"ref_{m}") for m in MOE for s in (2, 3)], ("mixtral_ep2_dp2", "ref_mixtral"),
    ("mixtral_z0", "ref_mixtral"), ("mixtral_z1", "ref_mixtral"), ("mixtral_z2", "ref_mixtral"),
    ("qwen2_moe_z0", "ref_qwen2_moe"), ("qwen3_moe_z1", "ref_qwen3_moe")])
def test_a_mixture_of_experts_trains_like_one_process(runs, name, reference):
    ran, ref = summary(runs / name), summary(runs / reference)
    margin = worst(ref["losses"], ran["losses"], MOE_STEPS)
    print(f"{name} vs {reference}: {margin:.2e}")
    assert margin <= RTOL
    expert = ran["ds_config"].get("expert_parallel", {}).get("autoep_size", 1)
    assert expert == (2 if "_ep2" in name else 1)


def test_an_expert_parallel_run_resumes_at_its_shape_and_at_four_ranks(runs):
    full = summary(runs / "mixtral_ep2_z2")["losses"]
    assert summary(runs / "ep_again")["losses"] == full  # the same shape: exactly
    assert worst(full, summary(runs / "ep_to4")["losses"], STEPS) <= RTOL  # 4 ranks, through a universal checkpoint
    assert (runs / "ep_to4" / "checkpoints" / "step_000002_universal").is_dir()
    said = (runs / "ep_to_none" / "error.txt").read_text()
    assert "expert parallel 2" in said and "resume with parallel.expert=2" in said and "\n" not in said.strip()


def test_the_export_of_an_expert_parallel_run_has_whole_experts_under_transformers_names(runs, tmp_path):
    """The same training with and without EP (losses 1e-7 apart) exports the same Mixtral. Exported in this process
    (the export's command line and its quiet console: tests/dist/test_parallel_modes.py)."""
    from transformers import AutoModelForCausalLM

    from bigtrain.export import export_checkpoint
    for run in ("mixtral_ep2_z2", "mixtral_z2"):
        assert export_checkpoint(runs / run, tmp_path / run).max_logit_diff == 0  # reloaded, as it was written
    split, plain = (AutoModelForCausalLM.from_pretrained(tmp_path / run) for run in ("mixtral_ep2_z2", "mixtral_z2"))
    weights = dict(plain.named_parameters())
    assert sorted(n for n, _ in split.named_parameters()) == sorted(weights)
    with torch.no_grad():
        worst_weight = max(float((p - weights[n]).abs().max()) for n, p in split.named_parameters())
    print(f"EP export vs plain export: largest weight difference {worst_weight:.2e}")
    assert worst_weight <= 1e-4


@pytest.mark.parametrize("name", ["tiled_z2", "sp2_tiled_z3", "sp2_tiled_ckpt"])
def test_alst_tiling_trains_like_one_process(runs, name):
    ran, ref = summary(runs / name), summary(runs / "ref_llama")
    assert ran["run_config"]["activation_checkpointing"]["tiled_mlp"] is True
    margin = worst(ref["losses"], ran["losses"], STEPS)
    print(f"{name} vs ref_llama: {margin:.2e}")
    assert margin <= RTOL
    log = "\n".join(p.read_text() for p in (runs / name / "logs").glob("*.log"))
    assert "tiled MLP (activation_checkpointing.tiled_mlp=True): 2 MLPs over tiles of" in log, log[-2000:]


@pytest.mark.parametrize("name, stage, expert", [("mixtral_ep2_z2", 2, 2), ("mixtral_z2", 2, 1), ("mixtral_z1", 1, 1),
                                                 ("mixtral_z0", 0, 1)])
def test_the_estimator_counts_what_an_expert_parallel_rank_holds(runs, name, stage, expert):
    """An EP rank holds 1/expert of the experts whole (ZeRO 0-2); ZeRO partitions the rest as without EP. The
    end-of-run count holds weights and optimizer states (ZeRO 0-2 have freed the gradients by then)."""
    from bigtrain.estimate.memory_model import Setup, estimate
    from bigtrain.estimate.shape import shape_from_spec
    from bigtrain.models import build
    ran = summary(runs / name)
    spec = build("hf", "custom", pretrained=str(runs / "moe_dirs" / "mixtral"), seq_len=32)
    shape = shape_from_spec(spec, "fp32")
    assert shape.expert_params > 0 and ran["model"]["num_params"] == shape.num_params
    est = estimate(shape, Setup(world_size=2, zero_stage=stage, precision="fp32", micro_batch=4, expert=expert))
    for measured in ran["model_state_bytes_per_rank"]:
        assert measured == pytest.approx(est.params + est.optimizer, rel=1e-3), (measured, est)


@pytest.mark.parametrize("name, stage, muon", [("muon_z1", 1, True), ("muon_z2", 2, True)])
def test_the_estimator_counts_muons_optimizer_states(runs, name, stage, muon):
    """Muon keeps one fp32 momentum per matrix it trains (DeepSpeed's own rule picks them) where Adam keeps two.
    Within 3%: measured 2.9% above at ZeRO-1 here, as if a matrix that a ZeRO partition boundary cuts kept more
    momentum than its share (DeepSpeed gathers such matrices whole for the update; not modelled)."""
    from bigtrain.estimate.memory_model import Setup, estimate
    from bigtrain.estimate.shape import shape_from_spec
    from bigtrain.models import build
    ran = summary(runs / name)
    shape = shape_from_spec(build("llama", "tiny", vocab_size=512, n_positions=256, seq_len=64))
    assert 0 < shape.muon_params < shape.num_params
    est = estimate(shape, Setup(world_size=2, zero_stage=stage, precision="fp32", micro_batch=4, muon=muon))
    for measured in ran["model_state_bytes_per_rank"]:
        assert measured == pytest.approx(est.params + est.optimizer, rel=0.03), (measured, est)
