"""On-policy distillation's parts (objective.kind=distill, bigtrain/objectives/distill.py), on tiny models made here:
the objective's step loss is DeepSpeed's generalized_jsd_loss (and TRL GKD's) on the same logits, split over
micro-batches as TRL's num_items_in_batch splits it; which steps sample; the records' answers as tokens; and the
one-line refusals (no teacher, a teacher with another tokenizer, a record without an answer)."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rl_task  # noqa: E402

from bigtrain.config.load import load_run_config  # noqa: E402
from bigtrain.objectives import build_objective  # noqa: E402
from bigtrain.objectives.distill import TEACHER, check_teacher, sampled_step  # noqa: E402
from bigtrain.objectives.round_pieces import Piece, StepState  # noqa: E402
from bigtrain.rollout.forward import completion_logits  # noqa: E402

SETS = ["objective.kind=distill", "objective.teacher=/models/teacher", "data.seq_len=64",
        "objective.max_completion_length=8"]


class Frozen:
    def __init__(self, model):
        self.model, self.directory = model, "teacher-dir"

    def completion_logits(self, *rows):
        with torch.no_grad():
            return completion_logits(self.model, *rows)


class FakePolicy:
    """What the objective asks of the stepper: the student's completion logits with their graph, the teacher's."""

    device, seed = "cpu", 0

    def __init__(self, student, teacher, tokenizer=None):
        self.student, self.teacher, self.tokenizer = student, Frozen(teacher), tokenizer

    def completion_logits(self, *rows):
        return completion_logits(self.student, *rows)

    def frozen(self, setting):
        assert setting == TEACHER.setting
        return self.teacher


def objective(*more: str):
    run = load_run_config(None, [*SETS, *more])
    return build_objective(run.objective)


def pieces(n: int = 2, rows: int = 3, width: int = 6) -> list[Piece]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        prompt = torch.randint(3, 20, (rows, 4), generator=g)
        pmask = torch.ones_like(prompt)
        pmask[0, :2] = 0  # a shorter prompt, left-padded
        completion = torch.randint(3, 20, (rows, width), generator=g)
        cmask = torch.ones_like(completion)
        cmask[1, 3:], cmask[2, 1:] = 0, 0
        out.append(Piece(prompt, pmask, completion, cmask))
    return out


@pytest.mark.parametrize("beta,temperature", [(1.0, 1.0), (0.0, 1.0), (0.5, 0.7)])
def test_the_step_loss_is_deepspeeds_and_trls_generalized_jsd(beta, temperature):
    """The shares of a step's micro-batches add up to DeepSpeed's generalized_jsd_loss over the step's tokens (and
    TRL GKD's generalized_jsd_loss, batchmean over the tokens), within 1e-6, gradients too; beta and temperature
    reach it (a swapped direction or a missing temperature differs by far more)."""
    from deepspeed.runtime.rollout.opsd import generalized_jsd_loss
    student, teacher = rl_task.make_model(0), rl_task.make_model(7)
    with torch.no_grad():
        teacher.model.embed_tokens.weight.mul_(4)  # a peaked teacher: the divergence is far from 0
    obj = objective(f"objective.beta={beta}", f"objective.temperature={temperature}")
    policy = FakePolicy(student, teacher)
    micro = pieces()
    step = obj.begin_step(policy, micro)
    total = sum(obj.micro_loss(policy, p, step)[0] / step.micro_batches for p in micro)
    total.backward()
    ours = [p.grad.clone() for p in student.parameters()]
    student.zero_grad()
    s = torch.cat([completion_logits(student, *p.rows) for p in micro])
    t = torch.cat([Frozen(teacher).completion_logits(*p.rows) for p in micro])
    mask = torch.cat([p.completion_mask for p in micro])
    want = generalized_jsd_loss(s, t, mask.bool(), beta=beta, temperature=temperature)
    want.loss.backward()
    assert total.item() == pytest.approx(want.loss.item(), abs=1e-6) and want.loss.item() > 0.05
    assert all(torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(ours, student.parameters()))
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    labels = torch.where(mask.bool(), 0, -100)
    trl = gkd.GKDTrainer.generalized_jsd_loss(s.detach(), t, labels=labels, beta=beta, temperature=temperature)
    assert total.item() == pytest.approx(trl.item(), abs=1e-6)
    metrics = obj.end_step(policy, step)
    assert 0 <= metrics["teacher_agreement"] <= 1 and metrics["entropy"] > 0
    assert {"time/teacher", "time/policy"} <= set(metrics) and "time/rewards" not in metrics  # no round here


def test_which_steps_sample_is_the_same_on_every_rank_and_after_a_resume():
    """A draw from (seed, step) alone: lmbda of the steps sample (within 0.05 over 2000), 1 all of them, 0 none."""
    draws = [sampled_step(5, k, 0.3) for k in range(2000)]
    assert draws == [sampled_step(5, k, 0.3) for k in range(2000)]
    assert abs(sum(draws) / 2000 - 0.3) < 0.05 and draws != [sampled_step(6, k, 0.3) for k in range(2000)]
    assert all(sampled_step(5, k, 1.0) for k in range(50)) and not any(sampled_step(5, k, 0.0) for k in range(50))


def test_the_records_answers_follow_their_prompts_as_supervised_training_renders_them():
    from bigtrain.data.chat import Renderer
    obj = objective("objective.lmbda=0")
    tok = rl_task.make_tokenizer()
    policy = FakePolicy(None, None, tok)
    records = [{"prompt": "say 3", "completion": "3"}, {"prompt": "say 4", "completion": "4 4 4 4 4 4 4 4 4 4"}]
    batch = {"prompt_ids": torch.tensor([[0, 2, 3, 11], [0, 2, 3, 12]]),
             "prompt_mask": torch.tensor([[0, 1, 1, 1]] * 2), "records": records}
    rollout = obj.record_answers(policy, batch)
    whole, mask = Renderer(tok, "prompt_completion")(records[0])
    assert rollout.completion_lists()[0] == [w for w, m in zip(whole, mask) if m] == [11, 1]  # "3" <eos>
    assert rollout.completion_lists()[1] == [12] * 8 and rollout.truncated.tolist() == [False, True]
    assert torch.equal(rollout.prompt_ids, batch["prompt_ids"])
    with pytest.raises(ValueError) as said:
        obj.record_answers(policy, {**batch, "records": [{"prompt": "say 3", "answer": "3"}] * 2})
    line = str(said.value)
    assert "\n" not in line and "objective.lmbda=0.0" in line and "'completion'" in line and "lmbda=1" in line


def test_a_conversations_answer_is_the_assistant_turn_after_the_generation_prompt(tmp_path):
    from bigtrain.data.prompts import PromptRenderer
    from local_chat import make_chat_tokenizer
    tok = make_chat_tokenizer(tmp_path, own_pad=True)
    renderer = PromptRenderer(tok)
    prompt = [{"role": "user", "content": "hello there"}]
    ids, mask = renderer.answer({"prompt": prompt, "completion": [{"role": "assistant", "content": "hi"}]})
    asked = renderer.prompt_ids(prompt)
    whole = tok.apply_chat_template(prompt + [{"role": "assistant", "content": "hi"}], tokenize=False)
    assert asked + ids == tok(whole, add_special_tokens=False)["input_ids"] and 1 in mask
    assert renderer.answer({"prompt": prompt, "completion": "hi"}) == (ids, mask)  # text answers a conversation


def test_bad_settings_are_one_line():
    for sets, words in [([], ("objective.teacher", "needs a teacher")),
                        (["objective.teacher=/t", "objective.beta=1.5"], ("objective.beta=1.5", "[0, 1]")),
                        (["objective.teacher=/t", "objective.lmbda=2"], ("objective.lmbda=2", "[0, 1]"))]:
        with pytest.raises(ValueError) as said:
            load_run_config(None, ["objective.kind=distill", "data.seq_len=64", "objective.max_completion_length=8",
                                   *sets])
        assert "\n" not in str(said.value) and all(w in str(said.value) for w in words), str(said.value)


def test_a_teacher_with_another_tokenizer_is_one_line_naming_both(tmp_path):
    from local_chat import make_chat_tokenizer
    student = rl_task.make_tokenizer(tmp_path / "student")
    rl_task.make_tokenizer(tmp_path / "same")
    other = make_chat_tokenizer(tmp_path / "other")
    policy = SimpleNamespace(tokenizer=student)
    check_teacher(policy, tmp_path / "same")  # the same vocabulary: no line
    check_teacher(policy, tmp_path / "no_tokenizer_here")  # no tokenizer: the output width is checked instead
    with pytest.raises(ValueError) as said:
        check_teacher(policy, tmp_path / "other")
    line = str(said.value)
    assert "\n" not in line and f"objective.teacher={tmp_path / 'other'}" in line
    assert f"{len(other)} tokens" in line and f"{len(student)} tokens" in line and "one tokenizer" in line


def test_the_end_of_run_sample_answers_with_the_objectives_generation_settings(capsys):
    """The end-of-run sample of a distillation run answers its held-out prompt as the run's own rounds do: at most
    objective.max_completion_length tokens, the objective's temperature, not train.sample_tokens; a run of the model's
    own loss keeps train.sample_tokens (the same prompt, seed and model answer past that length there)."""
    import contextlib

    from bigtrain.distributed.world import World
    from bigtrain.train.job import end_of_run_sample
    tok, model = rl_task.make_tokenizer(), rl_task.make_model(0).eval()
    prompt = tok("say 3")["input_ids"]
    lifeline = SimpleNamespace(bound=lambda *a: contextlib.nullcontext())
    data = SimpleNamespace(tokenizer=tok, bundle=SimpleNamespace(processor=None, sample_prompt=prompt))

    def answer(kind_objective) -> list[str]:
        engine = SimpleNamespace(is_pipeline=False, module=lambda: model, split=None, device="cpu",
                                 ds=SimpleNamespace(zero_optimization_stage=lambda: 0), objective=kind_objective)
        run = SimpleNamespace(train=SimpleNamespace(sample_tokens=24))
        end_of_run_sample(engine, data, run, World(0, 0, 1), lifeline)
        text = capsys.readouterr().out.split("---\n", 1)[1].split("\n---", 1)[0]
        return tok.tokenize(text)[len(prompt):]

    distilled = answer(objective("objective.max_completion_length=3"))
    own_loss = answer(build_objective(load_run_config(None, []).objective))
    print(f"end-of-run answers: distill {distilled}, lm {own_loss}")
    assert 1 <= len(distilled) <= 3 and len(own_loss) > 3
