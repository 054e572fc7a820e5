"""Agentic RL on real ranks: objective.environment (tests/tool_task.py's vault, which alone knows each box's code) with
a reward function of the user's that reads `environments=`, the model's turns those of the scripted model (calls
and answers decided by the context alone; tests/dist_scripts/agentic_runs.py), so that every run trains on known
conversations; the tokenizer's template tool_task's compact one, its calls read by the tokenizer's own
response_template (transformers' parse_response; tests/unit/test_agentic.py holds Qwen 2.5's template and the
formats bigtrain reads itself). One launch of 2 ranks, every job in it.

- Each step's loss on 2 ranks equals a plain one-process loop's (tests/grpo_reference.py from TRL's formulas, given
  both ranks' conversations and TRL's tool_mask: the results attended to, out of the loss and its token counts)
  within 1e-5, for a loss type at each ZeRO stage (0-3, ZeRO-3 with the weights gathered for each turn and left
  partitioned), a KL term against a frozen copy, RLOO, and distillation (the teacher scoring the same multi-turn
  context, the divergence over the model's tokens only); the rewards are recomputed from the conversations, apart
  from the run's;
- while one rank's rollouts take 3 turns and the other's 1 in the same step, every rank generates as often as the
  one that needs most (a rank with none left, an idle row), or the ZeRO-3 runs would hang (the launch has a
  timeout);
- a run stopped in the middle of a round (two steps a round, at ZeRO-3) resumes on the uninterrupted curve exactly;
- metrics tools/call_frequency, tools/failure_frequency, tools/turns and the time split's tools, samples.jsonl's
  whole conversations; the completion-length metrics count the model's tokens only;
- without --data the environment's reset makes each prompt;
- `bigtrain generate --zero3 --tools` in the same launch: rank 0 alone runs the tools and every rank goes on from
  its results.
"""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import torch

import grpo_reference as ref
import tool_task as tt
from launch import REPO, launch_jobs, summary

SCRIPT = REPO / "tests" / "dist_scripts" / "agentic_runs.py"
WIDTH, SEQ, STEPS, GROUP = 112, 160, 4, 4
OWN_PROMPTS = '''import random
import sys
sys.path.insert(0, {here!r})
from vault import Vault


class Booth(Vault):
    """The vault, its prompts its own: each reset draws a box and a ticket."""

    made = 0

    def __init__(self):
        Booth.made += 1
        self.draws = random.Random(Booth.made)

    def reset(self, **record):
        box, ticket = self.draws.randrange(10), self.draws.randrange(100)
        super().reset(box=box)
        return f"ticket {{ticket}}: open box {{box}}"
'''
WHOSE = '''import os


def whose() -> str:
    """The rank of the process that ran this call."""
    return "rank " + os.environ["RANK"]
'''
COMMON = ["--set", "batch.grad_accum=1", "--set", "precision=fp32", "--set", "logging.progress_bar=false", "--set", "train.sample_tokens=0",
          "--peak-tflops", "1", "--set", f"objective.max_completion_length={WIDTH}", "--set", f"data.seq_len={SEQ}",
          "--set", f"objective.num_generations={GROUP}", "--set", "optimizer.betas=[0.9,0.999]",
          "--set", "optimizer.weight_decay=0.01", "--set", "optimizer.torch_adam=true",
          "--set", "schedule.kind=constant",
          "--set", "schedule.warmup_steps=1", "--set", "schedule.min_lr_ratio=1.0", "--set", "logging.interval=1",
          "--set", "optimizer.lr=1e-2", "--set", "train.eval_batches=0", "--set", "batch.micro_batch=4"]
FIXED = ["--steps", str(STEPS), "--set", "checkpoint.at_end=false", "--set", "logging.csv=false"]
CASES = {  # name: (ZeRO stage and run-config settings, the plain loop's config)
    "dapo": (["zero.stage=0"], {}),
    "bnpo": (["zero.stage=1", "objective.loss_type=bnpo", "objective.scale_rewards=batch"],
             {"loss_type": "bnpo", "scale_rewards": "batch"}),
    "dr_grpo": (["zero.stage=2", "objective.loss_type=dr_grpo", "objective.beta=0.04"],
                {"loss_type": "dr_grpo", "beta": 0.04}),
    # the weights gathered for each turn; the curve a run stopped mid-round resumes on
    "grpo": (["zero.stage=3", "objective.loss_type=grpo", "objective.num_iterations=2", "objective.epsilon=0.02"],
             {"loss_type": "grpo", "num_iterations": 2, "epsilon": 0.02}),
    # left partitioned: each decode step's layers gathered. A sequence's ratio is exp of a sum over a hundred
    # tokens and more here: a small rate keeps it finite
    "rloo": (["zero.stage=3", "objective.ds3_gather_for_generation=false", "objective.kind=rloo",
              "objective.beta=0.05", "objective.num_iterations=2", "objective.epsilon=0.02", "optimizer.lr=3e-5"],
             {"algorithm": "rloo", "beta": 0.05, "num_iterations": 2, "epsilon": 0.02, "lr": 3e-5}),
}


def sets(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("agentic_rl")
    tok = tt.make_tokenizer(root / "model", compact=True)
    tt.make_model(tok, 0, root / "model")
    tt.make_model(tok, 7, root / "teacher")
    tok.save_pretrained(root / "teacher")
    tt.write_jsonl(root / "prompts.jsonl", tt.records(96))
    vault = tt.write_vault(root / "vault.py")
    (root / "booth.py").write_text(OWN_PROMPTS.format(here=str(root)))
    env = sets(f"objective.environment={vault}:Vault", f"objective.rewards=[{vault}:correct]")

    def job(name: str, *args: str, data: bool = True, **more: object) -> dict:
        return {"name": name, "args": ["--model", "hf", "--set", f"model.pretrained={root / 'model'}",
                                       *(["--data", str(root / "prompts.jsonl")] if data else []), *COMMON,
                                       *sets("objective.kind=grpo"), *env, *args], "scripted": True, **more}

    jobs = [job(name, *FIXED, *sets(*settings)) for name, (settings, _) in CASES.items()]
    resumed = ["--steps", str(STEPS), *sets(*CASES["grpo"][0])]
    jobs += [job("stop", *resumed, "--stop-after", "3"), job("resumed", *resumed, "--resume", copy_from="stop"),
             job("distill", *FIXED, *sets("zero.stage=0", "objective.kind=distill", "objective.beta=0.5",
                                          f"objective.teacher={root / 'teacher'}")),
             job("own_prompts", "--steps", "2", *sets(f"objective.environment={root}/booth.py:Booth",
                                                      f"objective.rewards=[{vault}:correct]"), data=False)]
    (root / "whose.py").write_text(WHOSE)
    jobs.append({"name": "generate", "generate": [
        "--mode", "generate", str(root / "model"), "--zero3", "--prompt", "ticket 3: open box 1", "--prompt", "again",
        "--tools", f"{root / 'whose.py'}:whose", "--max-new-tokens", "16", "--out", str(root / "generate" / "out.jsonl")]})
    started = time.perf_counter()
    launch_jobs(root, jobs, num_ranks=2, name="two", script=SCRIPT, timeout=600)
    print(f"launch wall time: {time.perf_counter() - started:.0f} s")
    return root


def rounds(run: Path) -> list[list[dict]]:
    """Each round's rows, rank 0's then rank 1's (the plain loop's micro-batches: one a rank)."""
    ranks = [[json.loads(line) for line in (run / f"rounds_rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1])
    return [a + b for a, b in zip(*ranks)]


def turns(run: Path) -> list[list[list[int]]]:
    """Each rank's rounds: how many rollouts each turn generated for (0: the idle row of a rank with none left)."""
    return [[json.loads(line) for line in (run / f"turns_rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]


def plain_rewards(rows: list[dict]) -> torch.Tensor:
    """correct + the vault's 0.5 for opening the prompt's box, read from the conversations (a last turn whose call
    was run but whose results did not fit counts as opened, as the vault saw it)."""
    out = []
    for row in rows:
        code, conversation = str(row["code"]), row["conversation"]
        last = conversation[-1]
        opened = any(m["role"] == "tool" and m["content"] == code for m in conversation) or any(
            c["function"]["arguments"].get("box") == row["box"] for c in last.get("tool_calls") or [])
        right = last["role"] == "assistant" and not last.get("tool_calls") and last["content"].strip() == code
        out.append(float(right) + 0.5 * opened)
    return torch.tensor(out)


def padded(rows: list[dict]) -> dict:
    """The plain loop's batch of recorded rows: prompts left-padded, completions right-padded, TRL's tool_mask."""
    width = max(len(r["prompt"]) for r in rows)
    length = max(len(r["completion"]) for r in rows)
    p, pm = torch.zeros((len(rows), width), dtype=torch.long), torch.zeros((len(rows), width), dtype=torch.long)
    c, cm = torch.zeros((len(rows), length), dtype=torch.long), torch.zeros((len(rows), length), dtype=torch.long)
    tm = torch.ones((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        p[i, width - len(r["prompt"]):], pm[i, width - len(r["prompt"]):] = torch.tensor(r["prompt"]), 1
        c[i, :len(r["completion"])], cm[i, :len(r["completion"])] = torch.tensor(r["completion"]), 1
        tm[i, :len(r["model"])] = torch.tensor(r["model"])
    return {"prompt_ids": p, "prompt_mask": pm, "completion_ids": c, "completion_mask": cm, "tool_mask": tm}


def plain_losses(run: Path, settings: dict, model_dir: Path) -> list[float]:
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    cfg = ref.Config(**{"num_generations": GROUP, "max_completion_length": WIDTH, "micro_batches": 2, "lr": 1e-2,
                        **settings})
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    reference = copy.deepcopy(model).eval() if cfg.beta else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    losses = []
    for rows in rounds(run):
        losses += ref.optimize(model, optimizer, padded(rows), plain_rewards(rows), cfg, reference)
    return losses[:STEPS]


@pytest.mark.parametrize("case", list(CASES))
def test_fixed_conversations_give_the_plain_loops_losses_with_the_results_out_of_the_loss(runs, case):
    torch.set_num_threads(1)
    ran = summary(runs / case)
    expected = plain_losses(runs / case, CASES[case][1], runs / "model")
    worst = max(abs(a - b) for a, b in zip(expected, ran["losses"]))
    counts = turns(runs / case)
    print(f"{case}: worst loss difference to the plain loop over {STEPS} steps {worst:.2e} (losses {ran['losses']}); "
          f"rollouts generated per turn, rank 0 {counts[0]}, rank 1 {counts[1]}")
    assert len(ran["losses"]) == STEPS and worst <= 1e-5, (expected, ran["losses"])
    assert len({round(v, 6) for v in ran["losses"]}) > 1
    rows = [r for step in rounds(runs / case) for r in step]
    assert any(0 in r["model"] for r in rows) and any(len(r["conversation"]) >= 5 for r in rows)  # results, 3 turns
    assert [len(t) for t in counts[0]] == [len(t) for t in counts[1]]  # as many turns on each rank, every round
    assert any(0 in a or 0 in b for a, b in zip(*counts)), counts  # a rank with none left generated an idle row


def test_distillation_scores_the_same_multi_turn_context_on_the_models_tokens(runs):
    """A plain loop: the teacher and the student on prompt + completion (the results attended to), DeepSpeed's
    generalized_jsd_loss over the model's tokens only, divided by their count over the step."""
    from deepspeed.runtime.rollout.opsd import generalized_jsd_loss
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    student = AutoModelForCausalLM.from_pretrained(runs / "model")
    teacher = AutoModelForCausalLM.from_pretrained(runs / "teacher").eval()
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2)
    expected = []
    for rows in rounds(runs / "distill"):
        b = padded(rows)
        loss_mask = b["completion_mask"] * b["tool_mask"]
        total, step = loss_mask.sum(), 0.0
        optimizer.zero_grad()
        for part in torch.arange(len(rows)).chunk(2):
            p, pm, c, cm = (b[k][part] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"))
            with torch.no_grad():
                t = _logits(teacher, p, pm, c, cm)
            out = generalized_jsd_loss(_logits(student, p, pm, c, cm), t, loss_mask[part].bool(), beta=0.5)
            loss = out.loss_sum / total
            loss.backward()
            step += loss.item()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        expected.append(step)
    ran = summary(runs / "distill")
    worst = max(abs(a - b) for a, b in zip(expected, ran["losses"]))
    print(f"distill with tools: worst loss difference to the plain loop {worst:.2e} ({ran['losses']})")
    assert len(ran["losses"]) == STEPS and worst <= 1e-5 and min(ran["losses"]) > 1e-3, (expected, ran["losses"])
    assert "tools/call_frequency" in ran["final_metrics"] and set(ran["time_split"]) == {"generation", "tools",
                                                                                          "teacher", "policy"}


def _logits(model, p, pm, c, cm) -> torch.Tensor:
    ids, mask = torch.cat([p, c], 1), torch.cat([pm, cm], 1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    return logits[:, p.shape[1] - 1:-1]


def test_metrics_time_split_and_samples_show_the_tools(runs):
    ran = summary(runs / "dapo")
    rows = [r for step in rounds(runs / "dapo") for r in step]
    final = ran["final_metrics"]
    assert {"tools/call_frequency", "tools/failure_frequency", "tools/turns", "rewards/correct/mean",
            "rewards/Vault/mean"} <= set(final)
    last = rounds(runs / "dapo")[-1]
    calls = sum(m["role"] == "tool" for r in last for m in r["conversation"])
    failures = [v for _, v in ran["metrics"]["tools/failure_frequency"]]
    assert 0 < max(failures) < 1 and final["tools/call_frequency"] >= calls / len(last)
    model_tokens = [sum(r["model"]) for r in last]
    assert final["completions/max_length"] == max(model_tokens)  # the model's tokens only
    assert final["completions/mean_length"] == pytest.approx(sum(model_tokens) / len(model_tokens))
    assert max(len(r["completion"]) for r in rows) > max(sum(r["model"]) for r in rows)
    split = ran["time_split"]
    assert set(split) == {"generation", "tools", "reference", "rewards", "policy"} and split["tools"]["mean_s"] > 0
    samples = [json.loads(line) for line in (runs / "dapo" / "samples.jsonl").read_text().splitlines()]
    conversation = samples[0]["conversation"]
    assert samples[0]["prompt"].startswith("ticket ") and conversation[0]["role"] == "assistant"
    assert any(m["role"] == "tool" for s in samples for m in s["conversation"])
    assert any(m.get("tool_calls") for s in samples for m in s["conversation"])


def test_a_run_stopped_mid_round_resumes_on_the_uninterrupted_curve(runs):
    full, stopped, resumed = (summary(runs / n) for n in ("grpo", "stop", "resumed"))
    assert stopped["losses"] == full["losses"][:3] and resumed["losses"] == full["losses"]
    for name in ("reward", "tools/call_frequency", "tools/turns", "entropy"):
        assert [v for _, v in resumed["metrics"][name]] == [v for _, v in full["metrics"][name]], name


def test_without_data_the_environment_makes_each_prompt(runs):
    ran = summary(runs / "own_prompts")
    samples = [json.loads(line) for line in (runs / "own_prompts" / "samples.jsonl").read_text().splitlines()]
    prompts = {s["prompt"] for s in samples}
    assert len(ran["losses"]) == 2 and len(prompts) > 1 and all(" open box " in p for p in prompts)
    assert ran["final_metrics"]["tools/call_frequency"] > 0


def test_generate_over_zero3_ranks_runs_the_tools_on_rank_0_and_every_rank_continues_from_its_results(runs):
    """`bigtrain generate --zero3 --tools` on 2 ranks, the model's turns scripted (a call, then the result as the
    answer): the tool ran on rank 0 alone (it answers with its rank), and both ranks generated from the same
    prompts, rank 0's result in them."""
    prompts = [json.loads((runs / "generate" / f"prompts_rank{r}.json").read_text()) for r in (0, 1)]
    assert prompts[0] == prompts[1] and len(prompts[0]) == 4  # two answers, each a call and then the answer
    assert "tools: whose()" in prompts[0][0] and "rank 0" in prompts[1][1] and "rank 1" not in "".join(prompts[1])
    records = [json.loads(line) for line in (runs / "generate" / "out.jsonl").read_text().splitlines()]
    assert [r["completion"] for r in records] == ["rank 0", "rank 0"]
    assert [m["role"] for m in records[0]["messages"]] == ["assistant", "tool", "assistant"]
    assert records[0]["messages"][1] == {"role": "tool", "name": "whose", "content": "rank 0"}
