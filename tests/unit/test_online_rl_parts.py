"""objective.kind=grpo / rloo without a launcher: TRL 1.16's defaults, the one-line refusals of what a
run cannot do (checked when the run config loads, and with the world known), the reward wiring's lines for a
function that returns the wrong count or a NaN (naming the function and the record), the objective's checkpoint
state loadable weights-only, the ZeRO-3 gather rule, and the reporting pieces (time split, sample table, tracker
text). Training itself, against the plain loop and across ranks: tests/dist/test_online_rl.py."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from messages import naming

from bigtrain.config.load import load_run_config

BASE = ["objective.kind=grpo", "objective.rewards=accuracy", "data.seq_len=64", "objective.max_completion_length=16",
        "batch.global_batch=16"]


def refusal(*sets: str, base: list[str] = BASE) -> str:
    with pytest.raises(ValueError) as err:
        load_run_config(None, [*base, *sets])
    return str(err.value)


def test_the_defaults_are_trls():
    grpo = load_run_config(None, ["objective.kind=grpo", "objective.rewards=accuracy", "data.seq_len=1024"])
    s = grpo.objective.settings
    assert (s.num_generations, s.max_completion_length, s.temperature, s.top_p, s.top_k) == (8, 512, 1.0, 1.0, 0)
    assert (s.beta, s.loss_type, s.scale_rewards, s.num_iterations, s.epsilon, s.epsilon_high) == (
        0.0, "dapo", "group", 1, 0.2, None)
    assert (s.importance_sampling_level, s.mask_truncated_completions, s.use_bias_correction_kl) == (
        "token", False, True)
    from bigtrain.rollout.losses import GRPOLoss
    assert GRPOLoss.of(s) == GRPOLoss()  # the loss's settings, TRL's defaults: delta, sapo_*, vespo_*, the masks off
    assert (s.delta, s.off_policy_mask_threshold, s.top_entropy_quantile, s.sapo_temperature_neg) == (
        None, None, 1.0, 1.05)
    assert grpo.objective.declared.references == ()  # beta 0: no reference model is built
    rloo = load_run_config(None, ["objective.kind=rloo", "objective.rewards=[accuracy, length]", "data.seq_len=1024"])
    r = rloo.objective.settings
    assert (r.num_generations, r.beta, r.normalize_advantages, r.rewards) == (2, 0.05, False, ["accuracy", "length"])
    assert rloo.objective.declared.references == ("adapters_off", "copy")
    dpo = load_run_config(None, ["objective.kind=dpo"]).objective.settings
    assert dpo.beta == 0.1  # a shared name keeps each objective's own default


@pytest.mark.parametrize("sets, needles", [
    (["data.seq_len=16"], ["data.seq_len=16", "max_completion_length", "16 tokens", "no room"]),
    (["pipeline.stages=2"], ["pipeline.stages=2", "objective.kind=grpo"]),
    (["parallel.tensor=2"], ["parallel.tensor=2", "sample alike"]),
    (["parallel.sequence=2"], ["parallel.sequence=2", "objective.kind=grpo"]),
    (["data.packing=true"], ["data.packing=true", "own row"]),
    (["objective.beta=0.1", "objective.reference=precomputed"], ["objective.reference=precomputed",
                                                                   "do not exist before the step"]),
    (["objective.reference=copy"], ["objective.reference=copy", "objective.beta=0", "no reference model"]),
    (["objective.rewards=null"], ["objective.rewards", "objective.reward_model"]),
    (["objective.reward_weights=[1.0, 2.0]"], ["objective.reward_weights", "2 weights for 1 rewards"]),
    (["objective.temperature=0"], ["objective.temperature=0", "> 0"]),
    # one completion a prompt: every advantage 0, a run of loss 0 that exited 0 (TRL refuses it too)
    (["objective.num_generations=1"], ["objective.num_generations=1", "2 or more"]),
    (["objective.loss_type=ppo"], ["objective.loss_type", "dapo"]),
    (["objective.delta=0.9"], ["objective.delta=0.9", "> 1"]),
    (["objective.loss_type=cispo", "objective.delta=2.0"], ["objective.delta=2.0", "objective.loss_type=cispo"]),
    (["objective.sapo_temperature_pos=2.0"], ["objective.sapo_temperature_pos=2.0", "sapo", "loss_type=dapo"]),
    (["objective.loss_type=sapo", "objective.sapo_temperature_neg=0"], ["objective.sapo_temperature_neg=0", "> 0"]),
    (["objective.loss_type=vespo", "objective.vespo_k_pos=-1"], ["objective.vespo_k_pos=-1", ">= 0"]),
    (["objective.loss_type=vespo", "objective.vespo_lambda_neg=0"], ["objective.vespo_lambda_neg=0", "> 0"]),
    (["objective.top_entropy_quantile=1.5"], ["objective.top_entropy_quantile=1.5", "[0, 1]"]),
    (["objective.off_policy_mask_threshold=0", "objective.num_iterations=2"],
     ["objective.off_policy_mask_threshold=0", "> 0"]),
    # on-policy every step: the mask would drop nothing
    (["objective.off_policy_mask_threshold=0.5"], ["objective.off_policy_mask_threshold=0.5", "num_iterations=1"]),
    (["train.compile=true"], ["train.compile=True", "objective.kind=grpo"]),
    (["batch.micro_batch=auto"], ["batch.micro_batch=auto", "objective.kind=grpo"]),
])
def test_what_a_run_cannot_do_is_one_line(sets, needles):
    said = refusal(*sets)
    assert len(said.splitlines()) == 1 and naming(said, *needles), said


def test_each_rank_must_hold_whole_groups_once_the_world_is_known():
    from bigtrain.objectives import batch_problem
    needs = load_run_config(None, BASE).objective.declared
    assert batch_problem("grpo", needs, (8, 1)) is None  # 2 ranks x 8: one group each
    said = batch_problem("grpo", needs, (4, 1))  # 4 ranks x 4 completions: half a group each
    assert naming(said, "objective.kind=grpo", "4 x 1 = 4", "multiple of 8", "batch.micro_batch")


GROUPS = ["objective.kind=grpo", "objective.rewards=accuracy", "data.seq_len=64", "objective.max_completion_length=16"]


@pytest.mark.parametrize("sets, world, batch, first", [
    # what a user tripped on: 2 ranks x micro 16 = 32 completions in groups of 3; global_batch=30 would not solve
    (["batch.micro_batch=16", "objective.num_generations=3"], 2, "32 = micro 16 x accum 1 x data-parallel 2",
     "batch.grad_accum=3"),
    (["batch.micro_batch=16", "batch.global_batch=32", "objective.num_generations=3"], 2,
     "32 = micro 16 x accum 1 x data-parallel 2", "batch.global_batch=96"),
    (["batch.global_batch=12"], 1, "12 = micro 4 x accum 3 x data-parallel 1", "batch.global_batch=16"),
    (["batch.micro_batch=6", "batch.grad_accum=1"], 4, "24 = micro 6 x accum 1 x data-parallel 4",
     "batch.grad_accum=4")])
def test_a_batch_of_part_groups_names_only_fixes_that_hold_beside_what_the_user_gave(sets, world, batch, first):
    """Each fix the line names, given as --set beside the user's own settings, resolves at the same world size to
    whole groups on every rank; the batch the user gave is named as it resolved."""
    from bigtrain.config.load import field_sources
    from bigtrain.ds.groups import group_problem
    run = load_run_config(None, [*GROUPS, *sets])
    said = group_problem(run, None, world, field_sources(None, [*GROUPS, *sets]))
    assert said is not None and len(said.splitlines()) == 1 and f"train_batch_size {batch} gives each rank" in said
    fixes = said.split("; set ", 1)[1].split(", or ")
    assert fixes[0] == first and len(fixes) >= 2 and "batch.global_batch=30" not in fixes, said
    for fix in fixes:
        followed = [*GROUPS, *sets, *fix.split(" and ")]
        assert group_problem(load_run_config(None, followed), None, world, field_sources(None, followed)) is None, fix
    whole = [*GROUPS, *sets[:-1], "objective.num_generations=2"] if world == 2 else None
    if whole:
        assert group_problem(load_run_config(None, whole), None, world, field_sources(None, whole)) is None


def test_a_deepspeed_jsons_batch_is_held_too():
    """The micro-batch a user's DeepSpeed JSON gives is kept by the fixes, as the runner keeps it."""
    from bigtrain.config.load import field_sources
    from bigtrain.ds.groups import group_problem
    sets = [*GROUPS, "objective.num_generations=3"]
    said = group_problem(load_run_config(None, sets), {"train_micro_batch_size_per_gpu": 16}, 2,
                         field_sources(None, sets))
    assert naming(said, "micro 16 x accum 1 x data-parallel 2", "set batch.grad_accum=3, or batch.micro_batch=15"), said


def test_bigtrain_train_refuses_part_groups_before_it_starts_a_rank(tmp_path, monkeypatch):
    """The line comes from the launching process's own check at the world size the launcher would start."""
    import argparse

    from bigtrain.launch import train as launch
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "say 3", "answer": "3"}\n' * 8)
    args = ["--model", "gpt2", "--size", "tiny", "--data", "prompts.jsonl", "--out", str(tmp_path / "run"),
            *[a for s in [*GROUPS, "batch.micro_batch=16", "objective.num_generations=3"] for a in ("--set", s)]]
    assert launch.launched_world_size(argparse.Namespace(launcher_arg=[], hostfile=None, num_gpus=2), 2) == 2
    assert launch.launched_world_size(argparse.Namespace(launcher_arg=["--include=localhost:0"], hostfile=None,
                                                         num_gpus=2), 2) is None
    said = launch.check_run_args(args, world_size=2)
    assert said is not None and naming(said, "num_generations=3", "data-parallel 2", "set batch.grad_accum=3"), said
    assert launch.check_run_args([*args, "--set", "objective.num_generations=4"], world_size=2) is None


def rollout_of(texts: list[str], tok) -> SimpleNamespace:
    ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    return SimpleNamespace(completion_lists=lambda: ids)


@pytest.fixture(scope="module")
def tok():
    import rl_task
    return rl_task.make_tokenizer()


def grpo_with(tmp_path, body: str, **settings):
    from bigtrain.objectives import build_objective
    (tmp_path / "mine.py").write_text(body)
    run = load_run_config(None, [*BASE, "objective.num_generations=2", f"objective.rewards=[{tmp_path}/mine.py:mine]",
                                 *[f"objective.{k}={v}" for k, v in settings.items()]])
    return build_objective(run.objective)


@pytest.mark.parametrize("body, needles", [
    ("def mine(completions, **kw):\n    return [1.0]\n", ["reward function 'mine'", "returned 1 rewards for 4"]),
    ("def mine(completions, answer, **kw):\n    return [float('nan') if a == '4' else 1.0 for a in answer]\n",
     ["reward function 'mine'", "returned nan", '"answer": "4"', '"prompt": "say 4"']),
])
def test_a_reward_that_returns_the_wrong_count_or_nan_is_one_line_naming_it(tmp_path, tok, body, needles):
    from bigtrain.objectives.round_pieces import Piece
    objective = grpo_with(tmp_path, body)
    policy = SimpleNamespace(tokenizer=tok, device="cpu")
    pieces = [Piece(*(torch.zeros((2, 1), dtype=torch.long),) * 2, torch.ones((2, 1), dtype=torch.long),
                    torch.ones((2, 1), dtype=torch.long), index=torch.arange(2 * i, 2 * i + 2)) for i in range(2)]
    batch = {"records": [{"prompt": "say 3", "answer": "3"}, {"prompt": "say 4", "answer": "4"}]}
    with pytest.raises(ValueError) as err:
        objective.score_round(policy, batch, rollout_of(["3", "4", "4", "a"], tok), pieces)
    assert len(str(err.value).splitlines()) == 1 and naming(str(err.value), *needles), str(err.value)


def test_rewards_reach_the_advantages_group_by_group(tmp_path, tok):
    """The record's columns reach the function, the weighted reward its group's advantages (TRL's: (r - mean) /
    (std + 1e-4)), and the sample table shows each completion with its reward; what the function logs (TRL's
    log_metric, log_extra) is a metric of the step and a column of OUT/samples.jsonl."""
    from bigtrain.metrics.samples import SampleLog
    from bigtrain.objectives.round_pieces import Piece
    objective = grpo_with(tmp_path, "def mine(completions, answer, log_metric, log_extra, **kw):\n"
                                    "    log_metric('mine/calls', 1.0)\n"
                                    "    log_metric('mine/calls', 3.0)\n"
                                    "    log_extra('expected', list(answer))\n"
                                    "    return [float(c == a) for c, a in zip(completions, answer)]\n")
    policy = SimpleNamespace(tokenizer=tok, device="cpu")
    pieces = [Piece(*(torch.zeros((2, 1), dtype=torch.long),) * 2, torch.ones((2, 1), dtype=torch.long),
                    torch.ones((2, 1), dtype=torch.long), index=torch.arange(2 * i, 2 * i + 2)) for i in range(2)]
    batch = {"records": [{"prompt": "say 3", "answer": "3"}, {"prompt": "say 4", "answer": "4"}]}
    metrics = objective.score_round(policy, batch, rollout_of(["3", "5", "4", "4"], tok), pieces)
    std = (0.5 ** 0.5)
    assert torch.allclose(pieces[0].advantages, torch.tensor([0.5, -0.5]) / (std + 1e-4))
    assert torch.equal(pieces[1].advantages, torch.zeros(2))  # both right: no signal
    assert metrics["reward"] == 0.75 and metrics["frac_reward_zero_std"] == 0.5
    assert metrics["mine/calls"] == 2.0  # the mean of what it logged
    table = objective.sample_table()
    assert [(r["prompt"], r["completion"], r["reward"], r["expected"]) for r in table] == [
        ("say 3", "3", 1.0, "3"), ("say 3", "5", 0.0, "3"), ("say 4", "4", 1.0, "4"), ("say 4", "4", 1.0, "4")]
    assert objective.sample_table() is None  # each round's rows once
    SampleLog(tmp_path).write(1, table)
    written = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["expected"] for r in written] == ["3", "3", "4", "4"]


class Answers:
    """A policy that answers every prompt with 1-4 random digits and its end-of-text (the same draws each call),
    its logits a fixed table of the token: what an objective asks of the engine, without a model."""

    def __init__(self, tok):
        self.tokenizer, self.device, self.seed = tok, "cpu", 0
        self.logits = torch.randn(len(tok), len(tok), generator=torch.Generator().manual_seed(0))

    def generate(self, prompt_ids, prompt_mask, sampling, rng, **kw):
        from bigtrain.rollout.generate import Rollout
        n, g = sampling.num_generations, torch.Generator().manual_seed(1)
        rows, width = prompt_ids.shape[0] * n, sampling.max_new_tokens
        lengths = torch.randint(1, 5, (rows,), generator=g)
        ids = torch.randint(8, 18, (rows, width), generator=g)  # the digits' ids
        positions = torch.arange(width).unsqueeze(0)
        ids = torch.where(positions == lengths.unsqueeze(1), 1, ids).masked_fill(positions > lengths.unsqueeze(1), 0)
        return Rollout(prompt_ids.repeat_interleave(n, 0), prompt_mask.repeat_interleave(n, 0), ids,
                       (positions <= lengths.unsqueeze(1)).long(), torch.zeros(rows, dtype=torch.bool))

    def completion_logits(self, prompt_ids, prompt_mask, completion_ids, completion_mask):
        return self.logits[completion_ids]


def eval_round(tmp_path, tok, prompts: list[str], **settings) -> tuple:
    """An objective (reward: the completion's length; the prompts of each call kept) and its eval_loss on
    `prompts`."""
    objective = grpo_with(tmp_path, "SEEN = []\n"
                                    "def mine(prompts, completions, **kw):\n"
                                    "    SEEN.append(list(prompts))\n"
                                    "    return [float(len(c)) for c in completions]\n", **settings)
    policy = Answers(tok)
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    item = objective.inputs(policy, {"prompt_ids": enc["input_ids"], "prompt_mask": enc["attention_mask"],
                                     "records": [{"prompt": p} for p in prompts]})
    return objective, objective.eval_loss(policy, item)


@pytest.mark.parametrize("kind, group, eval_group", [("grpo", 4, 2), ("rloo", 2, 1)])
def test_an_evaluation_samples_num_generations_eval_per_prompt(tmp_path, tok, kind, group, eval_group):
    """objective.num_generations_eval (TRL's): a held-out batch of micro_batch completions holds micro_batch /
    num_generations_eval prompts, each answered num_generations_eval times, scored and grouped so; training keeps
    num_generations."""
    prompts = [f"say {d}" for d in range(8 // eval_group)]
    objective, (loss, _, metrics) = eval_round(tmp_path, tok, prompts, kind=kind, num_generations=group,
                                               num_generations_eval=eval_group, beta=0.0)
    assert objective.eval_data_batch(8) == 8 // eval_group and objective.data_batch(8, 1) == 8 // group
    (seen,) = objective.functions[0].fn.__globals__["SEEN"]
    assert seen == [p for p in prompts for _ in range(eval_group)]  # 8 completions, eval_group a prompt
    assert torch.isfinite(loss) and "reward" in metrics
    assert (objective.group, objective.sampling.num_generations) == (group, group)  # training's again


def test_an_evaluations_dapo_loss_is_trls_on_every_rank(tmp_path, tok, monkeypatch):
    """TRL's evaluation divides dapo's token sum by num_items_in_batch / processes, and averages the ranks' losses:
    with 2 ranks holding as many tokens each (played here), a rank's dapo loss is its own token mean, bnpo's."""
    import bigtrain.objectives.online as online
    import bigtrain.rollout.losses as losses
    count = losses.global_count
    monkeypatch.setattr(losses, "global_count", lambda masks: 2 * count(masks))
    monkeypatch.setattr(online, "_world", lambda: 2)
    prompts = ["say 1", "say 2"]
    dapo = eval_round(tmp_path, tok, prompts, loss_type="dapo")[1][0]
    bnpo = eval_round(tmp_path, tok, prompts, loss_type="bnpo")[1][0]
    assert dapo.item() == pytest.approx(bnpo.item(), rel=1e-6) and abs(dapo.item()) > 1e-3


def test_the_objectives_checkpoint_state_loads_weights_only(tmp_path):
    """A rank's state (its sampling streams, the round the next steps reuse) holds tensors and plain values only:
    the rank's RNG file it is saved in loads with torch's weights-only unpickler."""
    from bigtrain.objectives import build_objective
    from bigtrain.objectives.round_pieces import Piece
    from bigtrain.rollout.generate import SampleRNG
    run = load_run_config(None, [*BASE, "objective.num_iterations=2"])
    objective = build_objective(run.objective)
    objective.rng, objective.eval_rng = SampleRNG(1, 0, "cpu"), SampleRNG(2, 0, "cpu")
    objective.held = [Piece(torch.ones((2, 3), dtype=torch.long), torch.ones((2, 3), dtype=torch.long),
                            torch.zeros((2, 4), dtype=torch.long), torch.ones((2, 4), dtype=torch.long),
                            advantages=torch.tensor([0.5, -0.5]))]
    objective.iteration, objective.round_metrics, objective.steps_done = 1, {"reward": 0.25}, 5
    torch.save({"objective": objective.state_dict()}, tmp_path / "rng_rank0.pt")
    state = torch.load(tmp_path / "rng_rank0.pt", weights_only=True)["objective"]
    again = build_objective(run.objective)
    again.load_state_dict(state)
    again.streams(SimpleNamespace(seed=99, device="cpu"))  # the saved streams win over a fresh seed
    assert torch.equal(again.rng.state, objective.rng.state) and again.iteration == 1 and again.steps_done == 5
    assert torch.equal(again.held[0].advantages, objective.held[0].advantages)
    assert again.round_metrics == {"reward": 0.25}


def test_zero3_weights_are_gathered_where_they_fit_one_device_and_the_start_line_says_why(monkeypatch):
    from deepspeed.accelerator import get_accelerator

    from bigtrain.rollout.generate import gather_choice
    module = torch.nn.Linear(1000, 1000)  # 4 MB of fp32 weights
    partitioned = SimpleNamespace(module=module, zero_optimization_partition_weights=lambda: True)
    accelerator = get_accelerator()
    monkeypatch.setattr(accelerator, "available_memory", lambda *a: 10 << 20)
    assert gather_choice(partitioned, "auto") == (True, (  # 4 MB <= half of 10 MB free
        "generation gathers the ZeRO-3 weights once per round (objective.ds3_gather_for_generation=auto: the whole "
        "model, 3.8 MiB, takes at most half of the 10.0 MiB free on the fullest device)"))
    monkeypatch.setattr(accelerator, "available_memory", lambda *a: 6 << 20)
    assert gather_choice(partitioned, "auto") == (False, (
        "generation leaves the ZeRO-3 weights partitioned (one all-gather per layer and decode step) "
        "(objective.ds3_gather_for_generation=auto: the whole model, 3.8 MiB, takes more than half of the 6.0 MiB "
        "free on the fullest device; true gathers them anyway)"))
    assert gather_choice(partitioned, True) == (True, "generation gathers the ZeRO-3 weights once per round "
                                                      "(objective.ds3_gather_for_generation=true)")
    whole = SimpleNamespace(module=module, zero_optimization_partition_weights=lambda: False)
    assert gather_choice(whole, "auto") == (True, "")  # below ZeRO-3 nothing to gather, nothing said


def test_the_time_split_and_the_log_line():
    from bigtrain.train.report import objective_line, time_split
    split = time_split({"time/generation": [(1, 3.0), (2, 1.0)], "time/policy": [(1, 2.0), (2, 2.0)],
                        "reward": [(1, 0.5)]})
    assert split == {"generation": {"mean_s": 2.0, "share": 0.5}, "policy": {"mean_s": 2.0, "share": 0.5}}
    line = objective_line({"reward": 0.5, "time/generation": 3.0, "time/policy": 1.0})
    assert line == "reward 0.5000 | time generation 3.00s (75%) policy 1.00s (25%)"


def test_the_sample_table_goes_to_its_file_and_tensorboard(tmp_path):
    """OUT/samples.jsonl gets each row with its step, a resumed run drops the rows after its checkpoint, and
    TensorBoard (DeepSpeed's monitor) gets the table as text."""
    from torch.utils.tensorboard import SummaryWriter

    from bigtrain.metrics import MetricsLogger
    from bigtrain.metrics.samples import SampleLog
    writer = SummaryWriter(str(tmp_path / "tb"))
    monitor = SimpleNamespace(enabled=True, tb_monitor=SimpleNamespace(summary_writer=writer))
    log = SampleLog(tmp_path, MetricsLogger(monitor=monitor))
    rows = [{"prompt": "say 3", "completion": "3 | x", "reward": 1.0}]
    log.write(1, rows)
    log.write(2, rows)
    writer.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()] == [1, 2]
    (event,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    assert b"bigtrain/samples" in event.read_bytes() and b"3 \\| x" in event.read_bytes()
    SampleLog(tmp_path, resumed_at=1)
    assert [json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()] == [1]


def test_prompt_records_are_read_with_room_for_the_completions():
    from bigtrain.train.inputs import example_options
    run = load_run_config(None, BASE)
    options = example_options(run.data, run.objective.declared)
    assert options.format == "prompt" and options.prompt_tokens == 64 - 16
    assert example_options(load_run_config(None, []).data, load_run_config(None, []).objective.declared
                           ).prompt_tokens is None


def test_a_collapse_is_one_warning_line_per_window_with_its_likely_causes():
    """Every group answered by the same tokens (or scored alike) at every step of a logging window: one line at the
    window's end, naming the learning rate and the temperature; not again while it lasts, again after a window
    without it; a window where one step had signal is none."""
    from bigtrain.rollout.collapse import CollapseWatch, identical_groups
    ids = torch.tensor([[5, 6, 1], [5, 6, 1], [5, 7, 0], [5, 6, 1]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
    assert identical_groups(ids, mask, 2).tolist() == [1.0, 0.0] and identical_groups(ids, mask, 1) is None
    assert identical_groups(ids * mask, mask, 2).tolist() == [1.0, 0.0]  # padding past the end is not compared
    watch = CollapseWatch(temperature=0.7)

    def window(steps: range, identical: float | None, zero_std: float | None) -> str | None:
        watch.identical = identical
        for step in steps:
            watch.step(step, zero_std)
        return watch.line()

    line = window(range(1, 11), 1.0, 1.0)
    assert line == ("steps 1-10: the completions of every group were the same tokens at every step since the last log "
                    "line, so every advantage is 0 and the policy learns nothing from them; unless every answer is "
                    "already right (the task solved), the policy has collapsed to one answer per prompt: a learning "
                    "rate too high (lower optimizer.lr) or a temperature too low (objective.temperature=0.7: raise it) "
                    "are the usual causes"), line
    assert window(range(11, 21), 1.0, 1.0) is None  # said once while it lasts
    assert window(range(21, 31), 0.5, 0.5) is None  # signal again
    flat = window(range(31, 32), 0.0, 1.0)  # different completions, equal rewards
    assert flat.startswith("step 31: every group's completions got equal rewards (frac_reward_zero_std 1)") and \
        flat.endswith("or rewards that cannot tell the completions apart"), flat
    watch.said = False
    watch.identical = 1.0
    watch.step(41, 1.0)
    watch.identical = 0.5
    watch.step(42, 0.5)
    assert watch.line() is None  # one step of the window had signal
    assert window(range(51, 53), None, None) is None  # distillation: neither groups nor rewards


def test_a_log_line_shows_the_objectives_metrics_averaged_since_the_last_one_and_an_evaluation_as_val(
        tmp_path, capsys):
    """logging.interval=2: the step line, the monitors and the "log" event hold each metric's mean over the two
    steps (as TRL's trainers log them), summary.json every step's; the eval line names them val_<name>, as the
    monitors do."""
    from bigtrain.config.load import load_run_config
    from bigtrain.distributed.world import World
    from bigtrain.train.report import Reporter, add_listener
    run = load_run_config(None, ["train.peak_tflops=1", "logging.interval=2", "train.steps=4",
                                 "logging.progress_bar=false"])
    spec = SimpleNamespace(flops_per_sample=1.0, tokens_per_sample=0, eval_metric="loss")
    engine = SimpleNamespace(ds=SimpleNamespace(), objective=SimpleNamespace(), last_eval_metrics={"reward": 0.5})
    reporter = Reporter(run, spec, {"train_batch_size": 8}, engine, World(0, 0, 1), tmp_path)
    logged: list[tuple[int, dict]] = []
    remove = add_listener(lambda event, step, values: logged.append((step, values)) if event == "log" else None)
    try:
        for step, reward in enumerate([0.0, 1.0, 0.5, 0.25], start=1):
            reporter.clock_restart()
            reporter.on_step(step, 1.0, 1e-3, {"reward": reward})
        reporter.on_eval(4, 0.3)
    finally:
        remove()
    assert [(step, values["reward"]) for step, values in logged] == [(2, 0.5), (4, 0.375)]
    assert reporter.metrics["reward"] == [(1, 0.0), (2, 1.0), (3, 0.5), (4, 0.25)]
    out = capsys.readouterr().out
    assert "step 2: reward 0.5000" in out and "step 4: reward 0.3750" in out
    assert "eval step 4: val loss 0.3000 | val_reward 0.5000" in out
