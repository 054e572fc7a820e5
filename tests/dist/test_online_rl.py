"""Online RL on real ranks: objective.kind=grpo and rloo through the runner, on tests/rl_task.py's toy task
("say 3" -> "3") with a tiny Llama directory and its word-level tokenizer (pad apart from end-of-text), the rewards
in a file of the user's (`rewards.py:correct`, `:digit_format`). Two launches (tests/dist_scripts/online_rl_runs.py):
one process, then 2 ranks.

- With the completions fixed (generation bypassed, the same completions for a prompt whatever its rank), each
  step's loss equals the plain one-process loop written from TRL's formulas (tests/grpo_reference.py, given the
  same batches) within 1e-5, for every loss_type, batch and no reward scaling, a cut completion masked, beta > 0
  against a frozen copy, two iterations with the clip active (token and sequence ratio), and RLOO;
- 2 ranks at ZeRO 0-3 (and RLOO at ZeRO-2) give the losses of one process;
- sampled for real at ZeRO-3 with a reference and two iterations a round, a run stopped in the middle of a round
  resumes on the uninterrupted curve exactly (the sampler, the SampleRNG and the held round restored), its
  metrics too;
- (how far it learns against TRL's own trainers, run as a user runs both: tests/dist/test_rl_learning.py;)
- LoRA at ZeRO-3 with its adapters off as the reference trains, writes its samples to TensorBoard's text, and
  exports merged into a directory transformers loads;
- a reward model directory, partitioned like the policy at ZeRO-3, scores as transformers scores it;
- bad input is one line: a reward file that does not import, a reward function that raises (naming it and the
  record), a record without a prompt.

On-policy distillation (objective.kind=distill) rides the same two launches, with a peaked teacher directory (a
tiny Llama of another seed, its embeddings scaled: its next-token distributions far from the student's):
- with the completions fixed, each step's loss equals a plain loop of DeepSpeed's generalized_jsd_loss over the
  step's tokens (AdamW, the same micro-batches) within 1e-5; half the steps on the records' answers
  (objective.lmbda=0.5), 2 ranks at ZeRO-3 give one process's losses;
- sampled for real, the student's agreement with its teacher on held-out prompts (the share of tokens where their
  likeliest next tokens agree, and the divergence) rises over a few steps;
- bad input is one line: a teacher with another tokenizer (naming both), no teacher, a record without an answer
  on a step that trains on answers.
"""
from __future__ import annotations

import copy
import json
import math
import time
from pathlib import Path

import pytest
import torch

import grpo_reference as ref
import rl_task
from launch import REPO, launch_jobs, summary
from messages import naming

SCRIPT = REPO / "tests" / "dist_scripts" / "online_rl_runs.py"
WIDTH, SEQ, STEPS = 4, 16, 4
REWARDS_FILE = '''import sys
sys.path.insert(0, {tests!r})
from rl_task import correct, digit_format


def raises(completions, answer, **kwargs):
    return [1.0 / (len(a) - len(a)) for a in answer]
'''
COMMON = ["--set", "precision=fp32", "--set", "logging.progress_bar=false", "--set", "train.sample_tokens=0",
          "--peak-tflops", "1", "--set", f"objective.max_completion_length={WIDTH}", "--set", f"data.seq_len={SEQ}",
          "--set", "optimizer.betas=[0.9,0.999]", "--set", "optimizer.weight_decay=0.01",
          "--set", "optimizer.torch_adam=true", "--set", "schedule.kind=constant", "--set", "schedule.warmup_steps=1",
          "--set", "schedule.min_lr_ratio=1.0", "--set", "logging.interval=1"]
FIXED = ["--steps", str(STEPS), "--set", "train.eval_batches=0", "--set", "batch.micro_batch=16",
         "--set", "optimizer.lr=1e-2", "--set", "checkpoint.at_end=false", "--set", "logging.csv=false"]
CASES = {  # name: (run-config settings, the plain loop's config)
    "dapo": ([], {}),
    "grpo": (["objective.loss_type=grpo", "objective.mask_truncated_completions=true"],
             {"loss_type": "grpo", "mask_truncated_completions": True}),
    "bnpo": (["objective.loss_type=bnpo", "objective.scale_rewards=batch"],
             {"loss_type": "bnpo", "scale_rewards": "batch"}),
    "dr_grpo": (["objective.loss_type=dr_grpo", "objective.scale_rewards=none"],
                {"loss_type": "dr_grpo", "scale_rewards": "none"}),
    "beta": (["objective.beta=0.04"], {"beta": 0.04}),
    "clipped": (["objective.num_iterations=2", "objective.epsilon=0.02", "objective.epsilon_high=0.03",
                 "optimizer.lr=3e-2", "objective.loss_type=grpo"],
                {"num_iterations": 2, "epsilon": 0.02, "epsilon_high": 0.03, "lr": 3e-2, "loss_type": "grpo"}),
    "sequence": (["objective.importance_sampling_level=sequence", "objective.loss_type=grpo",
                  "objective.num_iterations=2", "optimizer.lr=3e-2"],
                 {"importance_sampling_level": "sequence", "loss_type": "grpo", "num_iterations": 2, "lr": 3e-2}),
    # a sequence's ratio is exp of a sum over its tokens: a higher rate makes it sensitive to fp32 rounding
    "rloo": (["objective.kind=rloo", "objective.num_generations=8", "objective.beta=0.05",
              "objective.num_iterations=2", "objective.epsilon=0.02"],
             {"algorithm": "rloo", "beta": 0.05, "num_iterations": 2, "epsilon": 0.02}),
}
TWO_RANKS = {"z0": "dapo", "z1": "dapo", "z2": "dapo", "z3": "dapo", "rloo_z2": "rloo"}
SAMPLED = ["--set", "zero.stage=3", "--set", "batch.micro_batch=8", "--set", "batch.grad_accum=1",
           "--set", "objective.beta=0.04", "--set", "objective.num_iterations=2", "--set", "optimizer.lr=1e-2",
           "--set", "train.eval_batches=1", "--set", "train.eval_interval=0"]
TIMES: dict[str, float] = {}


def sets(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("online_rl")
    model = root / "model"
    rl_task.make_model(0, model)
    rl_task.make_tokenizer(model)
    rl_task.write_records(root / "prompts.jsonl", 64)
    (root / "no_prompt.jsonl").write_text('{"question": "say 3", "answer": "3"}\n' * 8)
    (root / "rewards.py").write_text(REWARDS_FILE.format(tests=str(REPO / "tests")))
    (root / "broken.py").write_text("import not_a_module_anywhere\n")
    make_reward_model(root / "judge")
    rewards = f"objective.rewards=[{root}/rewards.py:correct,{root}/rewards.py:digit_format]"
    make_teachers(root)
    # enough prompts that a fixed run's 4 steps of 32 stay within one pass over them (at a pass's end one process
    # and 2 ranks draw the next pass's first prompts differently)
    (root / "answers.jsonl").write_text("".join(json.dumps({**r, "completion": r["answer"]}) + "\n"
                                                for r in rl_task.records(200)))

    def job(name: str, data: str = "prompts.jsonl", *args: str, **more: object) -> dict:
        return {"name": name, "args": ["--model", "hf", "--set", f"model.pretrained={model}", "--data",
                                       str(root / data), *COMMON, *sets("objective.kind=grpo", rewards), *args],
                **more}

    one = [job(name, "prompts.jsonl", *FIXED, *sets("batch.grad_accum=2", *settings), fixed=True)
           for name, (settings, _) in CASES.items()]
    # "collapse": top-k 1 answers every prompt of a group alike, as a collapsed policy does
    one += [job("collapse", "prompts.jsonl", "--steps", "2", *sets("batch.micro_batch=16", "objective.top_k=1",
                                                                   "logging.interval=2", "train.eval_batches=0")),
            job("bad_import", "prompts.jsonl", *FIXED, *sets(f"objective.rewards=[{root}/broken.py:score]"),
                expect_error=True),
            job("raises", "prompts.jsonl", *FIXED, *sets(f"objective.rewards=[{root}/rewards.py:raises]",
                                                         "batch.grad_accum=2"), expect_error=True),
            job("no_prompt", "no_prompt.jsonl", *FIXED, expect_error=True)]
    one += distill_jobs(job, root)
    started = time.perf_counter()
    launch_jobs(root, one, num_ranks=1, name="one", script=SCRIPT)
    TIMES["one process"] = time.perf_counter() - started
    two = [job(name, "prompts.jsonl", *FIXED, *sets("batch.grad_accum=1", f"zero.stage={name[-1]}",
                                                    *CASES[case][0]), fixed=True)
           for name, case in TWO_RANKS.items()]
    two += [job("full", "prompts.jsonl", "--steps", "5", *SAMPLED),
            job("stop", "prompts.jsonl", "--steps", "5", "--stop-after", "3", *SAMPLED),
            job("resumed", "prompts.jsonl", "--steps", "5", "--resume", *SAMPLED, copy_from="stop"),
            job("lora", "prompts.jsonl", "--steps", "2", *SAMPLED, *sets("lora.r=8", "logging.tensorboard=true")),
            job("rm", "prompts.jsonl", "--steps", "2", *SAMPLED, *sets(f"objective.reward_model={root / 'judge'}",
                                                                       "objective.reward_weights=[1.0,1.0,0.5]")),
            job("distill_mixed_z3", "answers.jsonl", *FIXED, *sets("batch.grad_accum=1", "zero.stage=3",
                                                                   *DISTILL(root), *DISTILL_MIXED), fixed=True)]
    # groups of 3 in 2 ranks x micro 16: refused before a launch, as `bigtrain train` refuses it; the first fix it
    # names trains in the launch below
    from bigtrain.launch.train import check_run_args
    part_groups = ["--steps", "1", *sets("batch.micro_batch=16", "objective.num_generations=3",
                                          "train.eval_batches=0", "checkpoint.at_end=false")]
    refused = check_run_args([*job("part_groups", "prompts.jsonl", *part_groups)["args"], "--out",
                              str(root / "part_groups")], world_size=2) or ""
    (root / "part_groups.txt").write_text(refused)
    fix = refused.partition("; set ")[2].split(", or ")[0]
    two.append(job("fixed_groups", "prompts.jsonl", *part_groups, *sets(*fix.split(" and "))))
    started = time.perf_counter()
    launch_jobs(root, two, num_ranks=2, name="two", script=SCRIPT)
    TIMES["two ranks"] = time.perf_counter() - started
    print(f"launch wall times: {TIMES}")
    return root


def DISTILL(root: Path) -> list[str]:  # noqa: N802 (a constant of the launch's folder)
    return ["objective.kind=distill", f"objective.teacher={root / 'teacher'}"]


DISTILL_MIXED = ["objective.lmbda=0.5", "objective.beta=0.5"]
DISTILL_STEPS = 24


def distill_jobs(job, root: Path) -> list[dict]:
    """The one-process distillation jobs (the 2-rank one is in the fixture's second launch)."""
    fixed = [*FIXED, *sets("batch.grad_accum=2", *DISTILL(root))]
    return [job("distill_fixed", "answers.jsonl", *fixed, *sets("objective.beta=0.5"), fixed=True),
            job("distill_mixed", "answers.jsonl", *fixed, *sets(*DISTILL_MIXED), fixed=True),
            job("distill_learn", "answers.jsonl", "--steps", str(DISTILL_STEPS),
                *sets(*DISTILL(root), "batch.micro_batch=16", "optimizer.lr=1e-2", "train.eval_interval=4",
                      "train.eval_batches=2", "data.val_fraction=0.25", "checkpoint.at_end=false")),
            job("distill_tokenizer", "answers.jsonl", *fixed, *sets(f"objective.teacher={root / 'other_teacher'}"),
                expect_error=True),
            job("distill_no_answer", "prompts.jsonl", *fixed, *sets("objective.lmbda=0"), expect_error=True),
            job("distill_no_teacher", "answers.jsonl", *FIXED, *sets("objective.kind=distill"), expect_error=True)]


def make_teachers(root: Path) -> None:
    """ROOT/teacher: a tiny Llama of another seed whose embeddings (tied to its output) are scaled 4x, so its
    next-token distributions are peaked and far from the student's; ROOT/other_teacher: the same model with another
    tokenizer."""
    from local_chat import make_chat_tokenizer
    model = rl_task.make_model(7)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(4)
    for name in ("teacher", "other_teacher"):
        model.save_pretrained(root / name)
    rl_task.make_tokenizer(root / "teacher")
    make_chat_tokenizer(root / "other_teacher")


def make_reward_model(directory: Path) -> Path:
    """A one-label sequence classifier on the task's tokenizer, as objective.kind=reward exports one."""
    from transformers import LlamaConfig, LlamaForSequenceClassification
    torch.manual_seed(3)
    LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(rl_task.WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, num_labels=1, pad_token_id=0)).save_pretrained(directory)
    rl_task.make_tokenizer(directory)
    return directory


def plain_losses(run: Path, settings: dict, model_dir: Path) -> list[float]:
    """The plain loop (tests/grpo_reference.py) on the completions the run trained on (its fixed_rank0.jsonl), from
    the same initial weights, in the run's micro-batches."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    cfg = ref.Config(**{"num_generations": 8, "max_completion_length": WIDTH, "micro_batches": 2, "lr": 1e-2,
                        **settings})
    tok = rl_task.make_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    reference = copy.deepcopy(model).eval() if cfg.beta else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    losses = []
    for line in (run / "fixed_rank0.jsonl").read_text().splitlines():
        batch, rewards = recorded_batch(json.loads(line), cfg, tok)
        losses += ref.optimize(model, optimizer, batch, rewards, cfg, reference)
    return losses[:STEPS]


def recorded_batch(round_: dict, cfg: ref.Config, tok) -> tuple[dict, torch.Tensor]:
    """A recorded round as the plain loop's batch (prompts left-padded, completions right-padded) and its rewards,
    scored on the whole completions (as TRL does, a cut one too)."""
    n, prompts, made = cfg.num_generations, round_["prompts"], round_["completions"]
    width = max(map(len, prompts))
    p = torch.zeros((len(prompts) * n, width), dtype=torch.long)
    pm = torch.zeros_like(p)
    for i, tokens in enumerate(prompts):
        p[i * n:(i + 1) * n, width - len(tokens):], pm[i * n:(i + 1) * n, width - len(tokens):] = torch.tensor(tokens), 1
    c = torch.zeros((len(made), WIDTH), dtype=torch.long)
    cm = torch.zeros_like(c)
    for i, tokens in enumerate(made):
        c[i, :len(tokens)], cm[i, :len(tokens)] = torch.tensor(tokens), 1
    cut = torch.tensor(round_["cut"])
    texts = tok.batch_decode(made, skip_special_tokens=True)
    rows = [{"prompt": tok.decode(t, skip_special_tokens=True), "answer": tok.decode(t[-1:])}
            for t in prompts for _ in range(n)]
    rewards = ref.score(rl_task.REWARDS, [1.0, 1.0], [r["prompt"] for r in rows], texts, made, rows)
    if cfg.mask_truncated_completions:
        cm = cm * (~cut).long().unsqueeze(1)
    return {"prompt_ids": p, "prompt_mask": pm, "completion_ids": c, "completion_mask": cm}, rewards


@pytest.mark.parametrize("case", list(CASES))
def test_fixed_completions_give_the_plain_loops_losses(runs, case):
    torch.set_num_threads(1)
    ran = summary(runs / case)
    expected = plain_losses(runs / case, CASES[case][1], runs / "model")
    worst = max(abs(a - b) for a, b in zip(expected, ran["losses"]))
    print(f"{case}: worst loss difference to the plain loop over {STEPS} steps {worst:.2e} (losses {ran['losses']})")
    assert len(ran["losses"]) == STEPS and worst <= 1e-5, (expected, ran["losses"])
    assert len({round(v, 6) for v in ran["losses"]}) > 1  # the steps differ: the updates are compared too
    if case in ("clipped", "rloo"):
        clipped = [v for _, v in ran["metrics"]["clip_ratio/region_mean"]]
        assert max(clipped) > 0, "the clip never held: the test would not see it"
    if case == "beta":
        assert ran["final_metrics"]["kl"] > 0 and "reference_state_bytes_per_rank" in ran


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_two_ranks_at_every_zero_stage_train_like_one_process(runs, name):
    one, two = summary(runs / TWO_RANKS[name]), summary(runs / name)
    worst = max(abs(a - b) for a, b in zip(one["losses"], two["losses"]))
    print(f"{name} on 2 ranks vs 1 process: worst loss difference {worst:.2e}")
    assert len(two["losses"]) == STEPS and worst <= 1e-5, (one["losses"], two["losses"])
    assert two["final_metrics"]["reward"] == pytest.approx(one["final_metrics"]["reward"], abs=1e-6)


def test_metrics_time_split_and_samples_are_trls_and_written(runs):
    ran = summary(runs / "dapo")
    assert {"reward", "reward_std", "rewards/correct/mean", "rewards/correct/std", "rewards/digit_format/mean",
            "frac_reward_zero_std", "completions/mean_length", "completions/min_length", "completions/max_length",
            "completions/clipped_ratio", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
            "clip_ratio/region_mean"} <= set(ran["final_metrics"])
    assert "kl" not in ran["final_metrics"] and "kl" in summary(runs / "beta")["final_metrics"]
    split = ran["time_split"]
    assert set(split) == {"generation", "reference", "rewards", "policy"}
    assert split["policy"]["mean_s"] > 0 and sum(p["share"] for p in split.values()) == pytest.approx(1.0)
    assert summary(runs / "clipped")["time_split"]["reference"]["mean_s"] > 0  # the old policy's forward
    rows = [json.loads(line) for line in (runs / "dapo" / "samples.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rows} == set(range(1, STEPS + 1)) and len(rows) == STEPS * 32
    assert {"prompt", "completion", "reward", "advantage", "rewards/correct"} <= set(rows[0])
    assert rows[0]["prompt"].startswith("say ")
    assert ran["data"]["prompts"] == 64 and ran["data"]["too_long"] == 0


def test_a_run_stopped_mid_round_resumes_on_the_uninterrupted_curve(runs):
    """Sampled at ZeRO-3 on 2 ranks, two steps a round: stopped after step 3 (the round of steps 3-4 half used),
    resumed to step 5 (which samples a new round from the restored streams)."""
    full, stopped, resumed = (summary(runs / n) for n in ("full", "stop", "resumed"))
    assert stopped["losses"] == full["losses"][:3] and resumed["losses"] == full["losses"]
    for name in ("reward", "completions/mean_length", "kl", "entropy"):
        assert [v for _, v in resumed["metrics"][name]] == [v for _, v in full["metrics"][name]], name
    # steps 3-4 one round, step 5 a new one (its rewards or its lengths differ: either alone may coincide)
    rounds = list(zip(*([v for _, v in full["metrics"][name]] for name in ("reward", "completions/mean_length"))))
    assert rounds[2] == rounds[3] and rounds[3] != rounds[4], rounds
    assert full["val_losses"] and resumed["val_losses"] == full["val_losses"]
    restored = [line for line in (runs / "resumed" / "logs" / "rank0.log").read_text().splitlines()
                if "resumed from" in line]
    assert restored and "RNG restored" in restored[0]


def test_the_start_line_says_what_generation_does_with_the_zero3_weights(runs):
    """objective.ds3_gather_for_generation=auto, decided before the first step and said in the objective's start
    line: one path for GRPO and distillation at ZeRO-3; below ZeRO-3 there is nothing to gather or say."""
    for name, kind in (("full", "grpo"), ("distill_mixed_z3", "distill")):
        log = (runs / name / "logs" / "rank0.log").read_text().splitlines()
        line = next(line for line in log if f"bigtrain] objective {kind}" in line)
        assert naming(line, "completions per step; generation gathers the ZeRO-3 weights once per round "
                      "(objective.ds3_gather_for_generation=auto: the whole model, ", "free on the fullest device)")
    assert "ds3_gather" not in (runs / "rloo_z2" / "logs" / "rank0.log").read_text()


def test_a_run_made_to_collapse_says_so_in_one_warning_line(runs):
    """Every completion of every group the same tokens at both steps of the logging window: one line at its log step,
    naming the likely causes; a run whose groups differ says nothing of the kind."""
    log = (runs / "collapse" / "logs" / "rank0.log").read_text()
    said = [line for line in log.splitlines() if "collapsed" in line]
    assert len(said) == 1 and naming(said, "WARNING", "warning: steps 1-2: the completions of every group were the "
                                     "same tokens", "optimizer.lr", "objective.temperature=1: raise it"), said
    assert summary(runs / "collapse")["final_metrics"]["frac_reward_zero_std"] == 1.0
    assert "collapsed" not in (runs / "dapo" / "logs" / "rank0.log").read_text()


def test_part_groups_are_refused_before_the_launch_and_the_fix_named_trains(runs):
    """2 ranks x micro 16 completions in groups of 3: one line from the launching process's own check (no rank
    started), naming the batch as it resolves and fixes checked beside micro 16; the first, followed, trains."""
    said = (runs / "part_groups.txt").read_text()
    assert len(said.splitlines()) == 1 and naming(said, "objective.num_generations=3", "train_batch_size 32 = micro "
                                                  "16 x accum 1 x data-parallel 2", "set batch.grad_accum=3"), said
    ran = summary(runs / "fixed_groups")
    assert ran["steps"] == 1 and math.isfinite(ran["losses"][0]) and ran["ds_config"]["train_batch_size"] == 96
    assert ran["ds_config"]["train_micro_batch_size_per_gpu"] == 16  # the user's own, kept


def test_lora_trains_writes_its_table_and_exports_merged_for_transformers(runs, tmp_path):
    import contextlib
    import io

    from transformers import AutoModelForCausalLM

    from bigtrain.export.__main__ import main as export_main
    ran = summary(runs / "lora")
    assert len(ran["losses"]) == 2 and all(math.isfinite(v) for v in ran["losses"])
    assert ran["final_metrics"]["kl"] >= 0  # the base with its adapters off as the reference
    events = list((runs / "lora").rglob("events.out.tfevents.*"))
    assert events and any(b"bigtrain/samples" in e.read_bytes() for e in events)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = export_main([str(runs / "lora"), "--out", str(tmp_path / "merged")])
    assert code == 0, out.getvalue()[-2000:]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    base = AutoModelForCausalLM.from_pretrained(runs / "model").eval()
    ids = torch.tensor([[2, 3, 11]])
    with torch.no_grad():
        assert float((merged(ids).logits - base(ids).logits).abs().max()) > 1e-4  # the adapters are merged in
        assert merged.generate(ids, max_new_tokens=3, do_sample=False).shape[1] > 3


def test_a_reward_model_partitioned_at_zero3_scores_as_transformers_does(runs):
    """objective.reward_model at ZeRO-3 on 2 ranks: its scores of rank 0's completions (OUT/samples.jsonl) are those
    of the directory loaded by transformers, read at the last token, and weigh in the reward as weighted."""
    from transformers import AutoModelForSequenceClassification

    from bigtrain.rollout.reward_model import RewardModel
    ran = summary(runs / "rm")
    assert {"rewards/judge/mean", "rewards/judge/std", "rewards/correct/mean"} <= set(ran["final_metrics"])
    rows = [json.loads(line) for line in (runs / "rm" / "samples.jsonl").read_text().splitlines()]
    plain = RewardModel(AutoModelForSequenceClassification.from_pretrained(runs / "judge").eval(),
                        rl_task.make_tokenizer(), "judge")
    expected = plain(prompts=[r["prompt"] for r in rows], completions=[r["completion"] for r in rows])
    worst = max(abs(r["rewards/judge"] - e) for r, e in zip(rows, expected))
    print(f"reward model at ZeRO-3 vs transformers on {len(rows)} completions: worst difference {worst:.2e}")
    assert len(rows) == 8 and worst <= 1e-5 and len({round(e, 4) for e in expected}) > 1
    assert all(r["reward"] == pytest.approx(r["rewards/correct"] + r["rewards/digit_format"] + 0.5 * r["rewards/judge"],
                                            abs=1e-5) for r in rows)


def test_bad_input_is_one_line(runs):
    said = {name: (runs / name / "error.txt").read_text() for name in ("bad_import", "raises", "no_prompt")}
    for name, line in said.items():
        assert len(line.strip().splitlines()) == 1, (name, line)
    assert "broken.py" in said["bad_import"] and "does not import" in said["bad_import"] \
        and "not_a_module_anywhere" in said["bad_import"]
    assert "reward function 'raises'" in said["raises"] and "ZeroDivisionError" in said["raises"] \
        and "completion 0 (record {" in said["raises"] and '"answer": "' in said["raises"]
    assert naming(said["no_prompt"], "no_prompt.jsonl", "line 1", "prompt", "question")


# --- on-policy distillation ---------------------------------------------------------------------------------------

def plain_distill_losses(run: Path, root: Path, beta: float) -> list[float]:
    """A plain loop on the completions the run trained on (its fixed_rank0.jsonl): the student and the teacher
    loaded by transformers, each step's loss DeepSpeed's generalized_jsd_loss summed over the step's micro-batches'
    tokens and divided by their count (TRL's num_items_in_batch), AdamW as the run's."""
    from deepspeed.runtime.rollout.opsd import generalized_jsd_loss
    from transformers import AutoModelForCausalLM
    student = AutoModelForCausalLM.from_pretrained(root / "model")
    teacher = AutoModelForCausalLM.from_pretrained(root / "teacher").eval()
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2)
    cfg = ref.Config(num_generations=1, max_completion_length=WIDTH, micro_batches=2)
    losses = []
    for line in (run / "fixed_rank0.jsonl").read_text().splitlines():
        batch, _ = recorded_batch(json.loads(line), cfg, rl_task.make_tokenizer())
        total = batch["completion_mask"].sum()
        optimizer.zero_grad()
        step = 0.0
        for rows in torch.arange(len(batch["completion_ids"])).chunk(2):
            p, pm, c, cm = (batch[k][rows] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"))
            with torch.no_grad():
                t = plain_logits(teacher, p, pm, c, cm)
            out = generalized_jsd_loss(plain_logits(student, p, pm, c, cm), t, cm.bool(), beta=beta)
            loss = out.loss_sum / total
            loss.backward()
            step += loss.item()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        losses.append(step)
    return losses[:STEPS]


def plain_logits(model, p, pm, c, cm) -> torch.Tensor:
    ids, mask = torch.cat([p, c], 1), torch.cat([pm, cm], 1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    return logits[:, p.shape[1] - 1:-1]


def test_distillation_with_fixed_completions_gives_the_plain_loops_losses(runs):
    torch.set_num_threads(1)
    ran = summary(runs / "distill_fixed")
    expected = plain_distill_losses(runs / "distill_fixed", runs, beta=0.5)
    worst = max(abs(a - b) for a, b in zip(expected, ran["losses"]))
    print(f"distill: worst loss difference to the plain loop over {STEPS} steps {worst:.2e} ({ran['losses']})")
    assert len(ran["losses"]) == STEPS and worst <= 1e-5 and min(ran["losses"]) > 0.01, (expected, ran["losses"])
    assert {"entropy", "teacher_agreement", "completions/mean_length"} <= set(ran["final_metrics"])
    assert set(ran["time_split"]) == {"generation", "teacher", "policy"}


def test_distillation_on_two_ranks_at_zero3_trains_like_one_process_on_and_off_policy(runs):
    """objective.lmbda=0.5: some steps on the (fixed) completions, the others on the records' answers, the same
    steps on every rank and in one process."""
    one, two = summary(runs / "distill_mixed"), summary(runs / "distill_mixed_z3")
    worst = max(abs(a - b) for a, b in zip(one["losses"], two["losses"]))
    sampled = [v for _, v in one["metrics"]["on_policy"]]
    print(f"distill lmbda=0.5 on 2 ranks at ZeRO-3 vs 1 process: worst loss difference {worst:.2e}, on-policy steps "
          f"{sampled}")
    assert len(two["losses"]) == STEPS and worst <= 1e-5, (one["losses"], two["losses"])
    assert set(sampled) == {0.0, 1.0} and [v for _, v in two["metrics"]["on_policy"]] == sampled


def test_the_distilled_students_agreement_with_its_teacher_rises(runs):
    """Sampled for real: on held-out prompts, the share of the student's completion tokens where its likeliest next
    token is the teacher's rises, and the divergence falls, within a few steps."""
    ran = summary(runs / "distill_learn")
    agreement = [v for _, v in ran["val_metrics"]["teacher_agreement"]]
    divergence = [v for _, v in ran["val_losses"]]
    print(f"distill: held-out agreement with the teacher {agreement}, divergence {divergence} "
          f"({ran['wall_s']:.1f} s)")
    assert len(agreement) == DISTILL_STEPS // 4
    assert agreement[-1] > agreement[0] + 0.2 and agreement[-1] > 0.8
    assert divergence[-1] < divergence[0] / 3


def test_distillation_bad_input_is_one_line(runs):
    said = {n: (runs / n / "error.txt").read_text() for n in ("distill_tokenizer", "distill_no_answer",
                                                              "distill_no_teacher")}
    for name, line in said.items():
        assert len(line.strip().splitlines()) == 1, (name, line)
    assert naming(said["distill_tokenizer"], f"objective.teacher={runs / 'other_teacher'}", "20 tokens",
                  "one tokenizer")
    assert naming(said["distill_no_answer"], "objective.lmbda=0", "'completion'", "objective.lmbda=1")
    assert naming(said["distill_no_teacher"], "objective.teacher", "needs a teacher")
