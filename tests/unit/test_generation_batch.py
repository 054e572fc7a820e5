"""objective.generation_batch_size / steps_per_generation with TRL's meanings (bigtrain/rollout/generation_batch.py,
objectives/online.py), driven without a model (test_online_rl_parts' `Answers` policy): a round of
micro_batch x steps_per_generation completions per rank is sampled once and serves steps_per_generation /
grad_accum optimizer steps, each on its share of the round's rows (shuffled; advantages and the kept
log-probabilities moving with their rows), dapo dividing each step by the round's tokens over its steps, and a
checkpoint taken inside a round resuming on the round's next share; a step's micro-batches cut by the rows' lengths,
each loss type's step loss and gradient unchanged by it (bnpo's and the entropy quantile's rows left in order)."""
from __future__ import annotations

import pytest
import torch

from bigtrain.rollout.generation_batch import round_micro_batches
from bigtrain.rollout.losses import token_logps

from test_online_rl_parts import Answers, grpo_with, tok  # noqa: F401  (tok: the fixture)

REWARD = "def mine(completions, **kw):\n    return [float(len(c)) for c in completions]\n"
MICRO, ACCUM = 4, 2  # 4 completions a micro-batch, 2 micro-batches a step


def test_a_rounds_micro_batches_follow_trls_settings_and_cover_whole_steps():
    assert round_micro_batches(MICRO, ACCUM, 1, None, None) == ACCUM  # TRL's default: one step's
    assert round_micro_batches(MICRO, ACCUM, 2, 6, None) == 6
    assert round_micro_batches(MICRO, ACCUM, 2, None, 32) == 4  # 32 completions / (4 x 2 ranks)
    with pytest.raises(ValueError, match=r"generation_batch_size=20 is not a multiple of batch.micro_batch x ranks"):
        round_micro_batches(MICRO, ACCUM, 2, None, 20)
    with pytest.raises(ValueError, match=r"steps_per_generation=3 with batch.grad_accum=2: .* multiple of 2"):
        round_micro_batches(MICRO, ACCUM, 1, 3, None)
    from bigtrain.config.load import load_run_config
    with pytest.raises(ValueError, match="generation_batch_size and objective.steps_per_generation both set"):
        load_run_config(None, ["objective.kind=grpo", "objective.rewards=accuracy", "data.seq_len=64",
                               "objective.max_completion_length=16", "objective.steps_per_generation=4",
                               "objective.generation_batch_size=16"])


class Counting(Answers):
    """Answers that count its generation rounds."""

    rounds = 0

    def generate(self, *args, **kwargs):
        self.rounds += 1
        return super().generate(*args, **kwargs)


def batches(tok, prompts: int):
    """Endless batches of `prompts` prompt records, "say 0", "say 1", ... in order."""
    start = 0
    while True:
        texts = [f"say {(start + i) % 10}" for i in range(prompts)]
        enc = tok(texts, return_tensors="pt", padding=True, padding_side="left")
        yield {"prompt_ids": enc["input_ids"], "prompt_mask": enc["attention_mask"],
               "records": [{"prompt": t} for t in texts]}
        start += prompts


def test_a_round_of_two_steps_is_sampled_once_and_each_step_trains_on_its_share(tmp_path, tok):
    objective = grpo_with(tmp_path, REWARD, steps_per_generation=4)  # 2 completions a prompt
    policy = Counting(tok)
    assert objective.data_batch(MICRO, ACCUM) == MICRO * 4 // 2 and objective.steps_per_round == 2
    assert objective.uses_old_logps  # the second step is off-policy by then: TRL keeps the logps too
    data = batches(tok, 8)
    first, second, third = (objective.read_step(policy, data, ACCUM) for _ in range(3))
    assert policy.rounds == 2 and [len(s) for s in (first, second, third)] == [ACCUM] * 3  # the third: a new round
    rows = [(tuple(p.prompt_ids[i][p.prompt_mask[i].bool()].tolist()),
             tuple(p.completion_ids[i][p.completion_mask[i].bool()].tolist()), float(p.advantages[i]))
            for p in (*first, *second) for i in range(p.prompt_ids.shape[0])]
    assert len(rows) == 16 and sorted(r[0] for r in rows) == sorted(
        tuple(tok(f"say {d}")["input_ids"]) for d in range(8) for _ in range(2))  # each completion once
    for prompt in {r[0] for r in rows}:  # a group's advantages still sum to 0: they moved with their rows
        assert sum(r[2] for r in rows if r[0] == prompt) == pytest.approx(0.0, abs=1e-5)
    for piece in (*first, *second):  # the kept log-probabilities are those of the rows they sit beside
        expected = token_logps(policy.completion_logits(*piece.rows), piece.completion_ids) * piece.completion_mask
        assert torch.allclose(piece.old_logps * piece.completion_mask, expected, atol=1e-6)


def test_rows_are_shuffled_across_the_rounds_steps_and_dapo_divides_by_the_rounds_tokens_over_them(tmp_path, tok):
    objective = grpo_with(tmp_path, REWARD, steps_per_generation=4)
    policy = Answers(tok)
    objective.data_batch(MICRO, ACCUM)
    step = objective.read_step(policy, batches(tok, 8), ACCUM)
    prompts = [tok.decode(p.prompt_ids[i][p.prompt_mask[i].bool()]) for p in step for i in range(MICRO)]
    assert prompts != sorted(prompts)  # not the round's first four prompts in order
    state = objective.begin_step(policy, step)
    tokens = sum(int(p.completion_mask.sum()) for p in objective.held)
    assert float(state.step_tokens) == pytest.approx(tokens / 2)  # TRL: num_items_in_batch x accum / steps


def test_a_checkpoint_inside_a_round_resumes_on_its_next_share(tmp_path, tok):
    objective = grpo_with(tmp_path, REWARD, steps_per_generation=4)
    policy = Counting(tok)
    objective.data_batch(MICRO, ACCUM)
    data = batches(tok, 8)
    objective.read_step(policy, data, ACCUM)
    state = objective.state_dict()
    second = objective.read_step(policy, data, ACCUM)
    again = grpo_with(tmp_path, REWARD, steps_per_generation=4)
    again.data_batch(MICRO, ACCUM)
    again.load_state_dict(state)
    fresh = Counting(tok)
    resumed = again.read_step(fresh, data, ACCUM)
    assert fresh.rounds == 0  # no new round: the held one's second step
    for a, b in zip(second, resumed):
        assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.advantages, b.advantages)


class WithReference(Answers):
    """Answers with a reference of its own (a table of logits of another seed)."""

    def __init__(self, tok):
        super().__init__(tok)
        self.reference = torch.randn(len(tok), len(tok), generator=torch.Generator().manual_seed(2))

    def reference_completion_logits(self, prompt_ids, prompt_mask, completion_ids, completion_mask):
        return self.reference[completion_ids]


def one_step(tmp_path, tok, regroups: bool, settings: dict, monkeypatch) -> tuple:
    """A step's micro-batches read from a fresh objective (its rows grouped by length or not), the step's loss (the
    shares of its micro-batches summed) and its gradient (of the policy's table of logits)."""
    objective = grpo_with(tmp_path, REWARD, **settings)
    monkeypatch.setattr(type(objective), "regroups", regroups)
    policy = WithReference(tok)
    objective.data_batch(MICRO, ACCUM)
    pieces = objective.read_step(policy, batches(tok, 4 * objective.steps_per_round), ACCUM)
    state = objective.begin_step(policy, pieces)
    policy.logits.requires_grad_(True)
    loss = sum(objective.piece_loss(policy, p, state) for p in pieces)
    loss.backward()
    return pieces, loss.detach(), policy.logits.grad


@pytest.mark.parametrize("settings", [{"loss_type": t} for t in ("dapo", "grpo", "dr_grpo", "luspo", "cispo", "sapo",
                                                                 "vespo")]
                         + [{"kind": "rloo", "beta": 0.05}, {"beta": 0.04}, {"steps_per_generation": 4}])
def test_a_steps_micro_batches_hold_rows_of_like_lengths_and_its_loss_is_unchanged(tmp_path, tok, settings,
                                                                                   monkeypatch):
    """A step's rows are cut into micro-batches by length (the short completions together, trimmed to their own
    longest: less padding to run the policy on); each row keeps its advantage, the step its rows (a shuffled round:
    the same share of the round), and the step's loss and gradient are those of the rows in the rollout's order."""
    def rows(pieces):
        return sorted((tuple(p.prompt_ids[i][p.prompt_mask[i].bool()].tolist()),
                       tuple(p.completion_ids[i][p.completion_mask[i].bool()].tolist()), round(float(p.advantages[i]), 6))
                      for p in pieces for i in range(p.prompt_ids.shape[0]))
    grouped, loss, grad = one_step(tmp_path, tok, True, settings, monkeypatch)
    plain, expected, expected_grad = one_step(tmp_path, tok, False, settings, monkeypatch)
    lengths = [p.completion_mask.sum(-1) for p in grouped]
    assert lengths[0].max() <= lengths[1].min(), lengths
    widths = [sum(p.completion_ids.shape[1] for p in pieces) for pieces in (grouped, plain)]
    assert widths[0] < widths[1] if "steps_per_generation" not in settings else widths[0] <= widths[1], widths
    assert rows(grouped) == rows(plain) and any(r[2] != 0 for r in rows(plain))
    assert float(loss) == pytest.approx(float(expected), rel=1e-6, abs=1e-7)
    assert torch.allclose(grad, expected_grad, rtol=1e-5, atol=1e-7) and expected_grad.abs().max() > 1e-3


def test_a_loss_that_depends_on_the_split_keeps_the_rollouts_order(tmp_path, tok):
    """bnpo's token mean is each micro-batch's, as is the entropy quantile's threshold: their rows are not regrouped."""
    assert grpo_with(tmp_path, REWARD).regroups
    assert not grpo_with(tmp_path, REWARD, loss_type="bnpo").regroups
    assert not grpo_with(tmp_path, REWARD, top_entropy_quantile=0.5).regroups
