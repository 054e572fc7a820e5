"""Preference training on real ranks, from a Llama directory made here with a chat template (its
tokenizer's pad apart from its end-of-text, as Qwen2's), on conversational {prompt, chosen, rejected} records (the
chosen answers start with "yes", the rejected with "no"):

- DPO on 2 ranks at ZeRO 0-3 gives the losses of one process (micro 4 x accumulation 2 = micro 4 x 2 ranks), its
  first loss ln 2; with LoRA the base with its adapters off gives the losses of a frozen copy of the base;
- a stop and resume continues the uninterrupted curve exactly;
- the reference's log-probabilities computed once before training (objective.reference=precomputed) give the frozen
  copy's losses, and a resume reads them back;
- the policy exports as a Hugging Face directory that reloads with transformers and scores the held-out pairs as
  the run's last evaluation did (a reward model's export: tests/dist/test_reward_model.py).
"""
from __future__ import annotations

import contextlib
import io
import math
from pathlib import Path

import pytest
import torch

from launch import launch_jobs, summary
from local_chat import preference_pairs, write_jsonl
from local_lora import make_chat_base
from messages import naming

STEPS = 4
COMMON = ["--set", "precision=fp32", "--set", "logging.progress_bar=false", "--set", "train.sample_tokens=0",
          "--peak-tflops", "1", "--steps", str(STEPS), "--set", "train.eval_interval=0",
          "--set", "train.eval_batches=2",
          "--set", "batch.micro_batch=4", "--set", "batch.global_batch=8", "--set", "data.seq_len=48",
          "--set", "optimizer.lr=1e-2", "--set", "schedule.kind=constant", "--set", "schedule.warmup_steps=1"]
DPO = ["--set", "objective.kind=dpo"]
LORA = ["--set", "lora.r=8"]
PRECOMPUTED = ["--set", "objective.reference=precomputed"]
TWO_RANK = {"z0": ["--set", "zero.stage=0"], "z1": ["--set", "zero.stage=1"], "z2": ["--set", "zero.stage=2"],
            "z3": ["--set", "zero.stage=3"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("preference")
    base = make_chat_base(root / "bases", own_pad=True)["chat_llama"]  # pad != end-of-text, as Qwen2's
    pairs = preference_pairs(160)
    data = write_jsonl(root / "pairs.jsonl", pairs)  # 8 held out: one batch of 4 per rank
    kto = write_jsonl(root / "kto.jsonl", [{"prompt": p["prompt"], "completion": p["chosen" if i % 2 else "rejected"],
                                            "label": bool(i % 2)} for i, p in enumerate(pairs)])
    (root / "base.txt").write_text(str(base))

    def job(name: str, *extra: str, **more: object) -> dict:
        return {"name": name, "args": ["--model", "hf", "--set", f"model.pretrained={base}", "--data", str(data),
                                       *COMMON, *extra], **more}

    kto_job = job("kto", "--set", "objective.kind=kto")
    kto_job["args"][kto_job["args"].index(str(data))] = str(kto)
    launch_jobs(root, [job("ref", *DPO), kto_job], num_ranks=1, name="refs")
    two = [job(name, *DPO, *extra) for name, extra in TWO_RANK.items()]
    two += [job("lora_off", *DPO, *LORA, "--set", "zero.stage=3"),
            job("lora_copy", *DPO, *LORA, "--set", "zero.stage=3", "--set", "objective.reference=copy"),
            job("stop", *DPO, "--set", "zero.stage=3", "--stop-after", "2"),
            job("resumed", *DPO, "--set", "zero.stage=3", "--resume", copy_from="stop"),
            job("pre_stop", *DPO, *PRECOMPUTED, "--set", "zero.stage=3", "--stop-after", "2"),
            job("pre_resumed", *DPO, *PRECOMPUTED, "--set", "zero.stage=3", "--resume", copy_from="pre_stop"),
            job("orpo_on_chats", "--set", "objective.kind=orpo", expect_error=True, data="chats"),
            job("simpo_resumed", "--set", "objective.kind=simpo", "--set", "zero.stage=3", "--resume",
                copy_from="stop", expect_error=True)]
    for j in two:  # the chat records, not pairs: a preference objective refuses them
        if j.pop("data", None):
            j["args"][j["args"].index(str(data))] = str(root / "bases" / "chats.jsonl")
    launch_jobs(root, two, num_ranks=2, name="two")
    return root


def worst(reference: list[float], losses: list[float]) -> float:
    assert len(losses) == len(reference) == STEPS
    return max(abs(a - b) / abs(a) for a, b in zip(reference, losses))


@pytest.mark.parametrize("name", list(TWO_RANK))
def test_dpo_on_two_ranks_trains_like_one_process(runs, name):
    ran, ref = summary(runs / name), summary(runs / "ref")
    margin = worst(ref["losses"], ran["losses"])
    print(f"DPO {name} on 2 ranks vs 1 process: worst relative loss difference {margin:.2e}")
    assert margin <= 1e-5, (ref["losses"], ran["losses"])
    assert ref["losses"][0] == pytest.approx(math.log(2), abs=1e-6)  # the policy starts as the reference
    assert ref["losses"][-1] < ref["losses"][0] - 0.05  # it learns the preference
    metrics = ran["final_metrics"]
    assert metrics["rewards/accuracies"] > 0.5 and metrics["rewards/margins"] > 0
    assert set(metrics) == {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                            "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected"}
    if name == "z1":  # and in DeepSpeed's CSV monitor (rank 0's, the reference run's), per step and evaluation
        (margins,) = (runs / "ref" / "csv").rglob("bigtrain_rewards_margins.csv")
        assert margins.read_text().splitlines()[-1].startswith(f"{STEPS},")  # the log step (the run's last)
        assert list((runs / "ref" / "csv").rglob("bigtrain_val_rewards_accuracies.csv"))


def test_the_lora_base_with_adapters_off_is_the_same_reference_as_a_frozen_copy(runs):
    off, copy = summary(runs / "lora_off"), summary(runs / "lora_copy")
    assert off["losses"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert worst(copy["losses"], off["losses"]) <= 1e-6
    assert off["losses"][-1] < off["losses"][0]


def test_a_stopped_dpo_run_resumes_on_the_uninterrupted_curve(runs):
    assert summary(runs / "resumed")["losses"] == summary(runs / "z3")["losses"]


def test_precomputed_reference_logps_give_the_frozen_copys_losses_and_are_read_again_on_resume(runs):
    """objective.reference=precomputed: the copy's numbers computed once on 2 ranks at ZeRO-3 (then freed: no copy
    held while training), kept beside the prepared data and read back by the resume instead of computed again."""
    copy, stopped, resumed = summary(runs / "z3"), summary(runs / "pre_stop"), summary(runs / "pre_resumed")
    assert worst(copy["losses"], resumed["losses"]) <= 1e-5
    assert stopped["losses"] == resumed["losses"][:2] and resumed["losses"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert "reference_state_bytes_per_rank" not in stopped and "reference_state_bytes_per_rank" in copy
    first, again = stopped["data"]["reference_logps"], resumed["data"]["reference_logps"]
    assert first["computed_s"] > 0 and again["computed_s"] is None and first["files"] == [
        f.replace("pre_resumed", "pre_stop") for f in again["files"]]
    (table,) = map(Path, again["files"])
    assert table.parent.parent.parent.name == "data_cache" and table.with_suffix(".json").is_file()
    assert "read from" in (runs / "pre_resumed" / "logs" / "rank0.log").read_text()


def test_kto_starts_at_one_half_and_learns_which_answers_are_desirable(runs):
    """At the first step the policy is the reference: every answer's loss is 1 - sigmoid(0)."""
    ran = summary(runs / "kto")
    assert ran["losses"][0] == pytest.approx(0.5, abs=1e-6) and ran["losses"][-1] < ran["losses"][0]
    final = ran["final_metrics"]
    assert final["rewards/chosen"] > final["rewards/rejected"] and final["kl"] >= 0


def test_a_preference_objective_on_single_examples_is_one_line(runs):
    error = (runs / "orpo_on_chats" / "error.txt").read_text()
    assert "\n" not in error and "objective.kind=orpo" in error and "chosen" in error


def _export(run: Path, out: Path) -> str:
    from bigtrain.export.__main__ import main
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main([str(run), "--out", str(out)])
    assert code == 0, stderr.getvalue()[-3000:]
    return stdout.getvalue()


def held_out_pairs(run: Path) -> dict[str, torch.Tensor]:
    """The run's held-out pairs, as its evaluation read them (the prepared corpus in its data cache)."""
    from bigtrain.data import build_data
    from bigtrain.data.pairs import flat_pairs
    base = (run.parent / "base.txt").read_text()
    bundle = build_data(str(run.parent / "pairs.jsonl"), "text", seq_len=48, tokenizer=base,
                        cache_dir=run / "data_cache", tokenizer_dir=run / "t")
    return flat_pairs(bundle.val.take(list(range(len(bundle.val)))))


def test_the_exported_policy_scores_the_held_out_pairs_as_the_run_did(runs, tmp_path):
    """The DPO validation loss of the last evaluation, recomputed from the export and the base directory through
    transformers alone."""
    from transformers import AutoModelForCausalLM

    from bigtrain.models.losses import answer_logps
    _export(runs / "ref", tmp_path / "policy")
    rows = held_out_pairs(runs / "ref")
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "policy").eval()
    base = AutoModelForCausalLM.from_pretrained((runs / "base.txt").read_text()).eval()
    with torch.no_grad():
        pol, _ = answer_logps(policy(rows["input_ids"]).logits, rows["labels"])
        ref, _ = answer_logps(base(rows["input_ids"]).logits, rows["labels"])
    n = len(pol) // 2
    z = (pol[:n] - ref[:n]) - (pol[n:] - ref[n:])
    loss = float(-torch.nn.functional.logsigmoid(0.1 * z).mean())
    ran = summary(runs / "ref")["val_losses"][-1][1]
    print(f"held-out DPO loss: run {ran:.6f}, from the export {loss:.6f}")
    assert loss == pytest.approx(ran, rel=1e-5) and loss < math.log(2)


@pytest.mark.parametrize("name, stage", [("z1", 1), ("z3", 3)])
def test_the_frozen_copys_memory_is_what_the_estimate_counts(runs, name, stage):
    """The reference engine's weights per rank, counted from its tensors after the run, against `bigtrain estimate`'s
    term for objective.reference=copy (whole on each rank at ZeRO-1, half of it on each of 2 ranks at ZeRO-3)."""
    from bigtrain.estimate.memory_model import Setup, estimate
    from bigtrain.estimate.shape import shape_from_spec
    from bigtrain.models import build
    measured = max(summary(runs / name)["reference_state_bytes_per_rank"])
    spec = build("hf", "custom", pretrained=(runs / "base.txt").read_text(), seq_len=48)
    setup = Setup(world_size=2, zero_stage=stage, precision="fp32", micro_batch=4, rows_per_sample=2, reference="copy")
    estimated = estimate(shape_from_spec(spec, "fp32"), setup).reference
    print(f"reference copy at ZeRO-{stage} on 2 ranks: measured {measured} B per rank, estimated {estimated:.0f} B")
    assert measured == pytest.approx(estimated, rel=0.01)
    assert summary(runs / "lora_off").get("reference_state_bytes_per_rank") is None  # adapters off: no copy


def test_a_resume_under_another_objective_is_one_line(runs):
    """--resume of the DPO run with objective.kind=simpo trained on from DPO's optimizer state and step count under
    the new loss, exit 0: now one line naming both kinds and the fix."""
    error = (runs / "simpo_resumed" / "error.txt").read_text()
    assert "\n" not in error and naming(error, "--resume", "objective.kind=dpo", "simpo"), error
