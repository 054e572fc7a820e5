"""What every objective that generates its own answers shares (GRPO and RLOO, grpo.py; on-policy distillation,
distill.py): prompts in, a round of completions sampled from the policy (`completions`), the round cut into the
step's micro-batches, several optimizer steps over one round (num_iterations), its random stream and what it holds
in the checkpoint, the time of a step split into its parts, and a table of what it sampled.

A step (bigtrain/rollout/__init__.py has the plan; `OnlineObjective.read_step`):
1. generation: this rank's prompts, one batch of micro_batch x grad_accum / num_generations records a step
   (`data_batch`; the global batch counts completions, as TRL's does), each answered num_generations times by
   `Policy.generate` from the objective's own `SampleRNG` (seeded from train.seed and the rank, saved with the
   checkpoint), the ZeRO-3 weights gathered for the round where they fit (objective.ds3_gather_for_generation);
2. reference: per micro-batch, the log-probabilities the loss compares with (the policy's before the update, a
   frozen reference's), without a graph (`uses_old_logps`, `uses_reference`);
3. rewards: what the subclass makes of the round (`score_round`: rewards, advantages, their metrics);
4. policy: `micro_loss` on each micro-batch (the subclass's `piece_loss`: its share of the step's loss), DeepSpeed's
   backward and step. With num_iterations = k the next k - 1 steps reuse the round (`read_step` reads no data).
The seconds of 1-4 are the metrics time/generation, time/reference, time/rewards and time/policy (0 for a part a
step skips), each rank's, averaged over the ranks.

A micro-batch's loss is its share of the step's loss (bigtrain.rollout.losses) times accumulation steps x ranks,
which DeepSpeed's backward divides by again: the step's loss is what TRL's is, however it is split.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterator

from bigtrain.objectives.base import FrozenModel, Metrics, Needs, Objective, Policy
from bigtrain.objectives.generation_settings import GenerationSettings
from bigtrain.objectives.round_pieces import (Clock, Piece, StepState, gather_rows, reduce_sums_local,
                                              split_rollout)

if TYPE_CHECKING:
    import torch

ONLINE_REFUSALS = {
    "pipeline": "generation runs on the whole model, which pipeline stages split",
    "tensor": "not supported: the ranks of a tensor-parallel group would have to sample alike",
    "sequence": "not supported: generation runs on whole sequences",
    "packing": "each prompt is generated from on its own row",
    "chunked_loss": "its loss reads every completion token's log-probability from the logits",
    "compile": "not supported (generation changes the shapes every step)",
    "auto_micro_batch": "the probe sizes rows of training data, not a round of completions",
    "precomputed": "its completions do not exist before the step, so their reference log-probabilities cannot be "
                   "computed before training",
    "completion_tokens": "its completions (objective.max_completion_length)"}
NO_REFERENCE = "objective.beta=0 builds no reference model (TRL's default); set objective.beta > 0 for a KL term"
class OnlineObjective(Objective):
    """An objective that samples its completions (see the module's docstring); a subclass scores a round
    (`score_round`) and gives a micro-batch's loss (`piece_loss`)."""

    # what the class declares before settings decide (the kinds a layout fits, the references' help); `declare`
    # gives a run's
    needs = Needs(layout="prompts", generates=True, references=("adapters_off", "copy"), refuses=ONLINE_REFUSALS)
    Settings = GenerationSettings
    samples = "completions"

    @staticmethod
    def online_needs(settings: Any, reference: bool, frozen: tuple[FrozenModel, ...]) -> Needs:
        """The declaration every online objective makes: prompt records, whole groups on every rank, room for the
        completions, no pipeline / tensor / sequence split; a live reference when `reference` (else none)."""
        refs = ("adapters_off", "copy") if reference else ()
        why = {} if refs else {"copy": NO_REFERENCE, "adapters_off": NO_REFERENCE}
        own = (settings.environments or {}).keys() == {None}  # one environment: its reset may make every prompt
        return Needs(layout="prompts", generates=True, own_prompts=own, samples_per_record=settings.num_generations,
                     samples_setting="objective.num_generations",
                     completion_tokens=settings.max_completion_length, references=refs, frozen_models=frozen,
                     gathers_weights=settings.ds3_gather_for_generation,
                     refuses={**ONLINE_REFUSALS, **why, "samples_per_record":
                              f"each prompt's objective.num_generations={settings.num_generations} completions are "
                              "a group, and every rank generates whole groups"})

    def __init__(self, kind: str, settings: Any = None, reference: str = "none"):
        super().__init__(kind, settings, reference)
        from bigtrain.rollout.collapse import CollapseWatch
        from bigtrain.rollout.generate import Sampling
        s = self.settings
        self.group = s.num_generations  # completions per prompt (in an evaluation, eval_group's while it runs)
        self.eval_group = getattr(s, "num_generations_eval", None) or s.num_generations
        self.iterations = getattr(s, "num_iterations", 1)  # optimizer steps over one round
        self.sampling = Sampling(s.max_completion_length, s.temperature, s.top_p, s.top_k, s.num_generations,
                                 s.decode)
        self.eval_sampling = replace(self.sampling, num_generations=self.eval_group)
        self.rng: Any = None  # the SampleRNG of training rounds, and of evaluations (made at the first round)
        self.eval_rng: Any = None
        self.pending: dict | None = None  # a checkpoint's state, applied at the first round
        self.held: list[Piece] = []  # the round the next steps train on (num_iterations, steps_per_generation)
        self.iteration = 0  # steps taken on the held round
        self.round_pieces: int | None = None  # micro-batches of a round on this rank (data_batch: TRL's
        self.steps_per_round = 1  # steps_per_generation), and the optimizer steps they make
        self.round_tokens: torch.Tensor | None = None  # a round's completion tokens over every rank
        self.steps_done = 0  # optimizer steps this run has taken (TRL's trainer_state.global_step), in the checkpoint
        self.round_metrics: Metrics = {}
        self.table: list[dict] | None = None
        self.times: dict[str, float] = {}
        self.collapse = CollapseWatch(s.temperature)  # every group answered alike over a logging window
        self.agent = _agent(s)  # objective.tools / objective.environment: rollouts over several turns, or None

    # -- what the subclass gives --------------------------------------------------------------------------------

    uses_old_logps = False  # the loss compares with the policy's log-probabilities before the round's updates
    uses_reference = False  # ... and with the reference's
    # whether a step's loss is the same however its rows are split into its (equal) micro-batches: a round's
    # micro-batches then each hold rows of like lengths (bigtrain.rollout.generation_batch.by_length)
    regroups = True

    def score_round(self, policy: Policy, batch: dict, rollout: Any, pieces: list[Piece]) -> Metrics:
        """Set each piece's advantages from the round's completions (`rollout`: this rank's, in groups, prompt by
        prompt; `batch["records"]`: their records); the round's metrics. May set `self.table`."""
        raise NotImplementedError

    def piece_loss(self, policy: Policy, piece: Piece, step: StepState) -> torch.Tensor:
        """A micro-batch's share of the step's loss; its metrics go to `step.sums` as (sum, count)."""
        raise NotImplementedError

    # -- the step ------------------------------------------------------------------------------------------------

    def data_batch(self, micro_batch: int, micro_batches: int) -> int:
        """Prompts a round reads on this rank (a round: objective.steps_per_generation / generation_batch_size's
        micro-batches, by default one step's: bigtrain.rollout.generation_batch)."""
        from bigtrain.rollout.generation_batch import round_micro_batches
        s = self.settings
        self.round_pieces = round_micro_batches(micro_batch, micro_batches, _world(),
                                                getattr(s, "steps_per_generation", None),
                                                getattr(s, "generation_batch_size", None))
        self.steps_per_round = self.round_pieces // micro_batches
        return max(1, micro_batch * self.round_pieces // self.group)

    def sample_settings(self) -> Any:
        return self.sampling

    def eval_data_batch(self, micro_batch: int) -> int:
        return max(1, micro_batch // self.eval_group)

    def inputs(self, policy: Policy, batch: dict) -> dict:
        pixels = batch.get("pixels")  # a vision-language model's images of the prompts
        return {"prompt_ids": batch["prompt_ids"].to(policy.device), "prompt_mask": batch["prompt_mask"].to(
            policy.device), "records": batch["records"], **({"pixels": pixels.to(policy.device)} if pixels is not None else {})}

    def read_step(self, policy: Policy, batches: Iterator[dict], micro_batches: int) -> list[Piece]:
        self.times = dict.fromkeys(("generation", "tools", "reference", "rewards") if self.agent else
                                   ("generation", "reference", "rewards"), 0.0)
        from bigtrain.rollout.generation_batch import steps_over
        self.streams(policy)  # first: a checkpoint's held round is put back here
        if self.held and self.iteration < self.iterations * self.steps_per_round:
            self.iteration += 1
            return steps_over(self.held, micro_batches, self.iteration - 1)
        self.held = self.round(policy, self.inputs(policy, next(batches)), self.round_pieces or micro_batches,
                               self.rng, shuffle=self.steps_per_round > 1)
        self.round_tokens, self.iteration = None, 1
        return steps_over(self.held, micro_batches, 0)

    def round(self, policy: Policy, batch: dict, pieces: int, rng: Any, shuffle: bool = False) -> list[Piece]:
        """A round of completions for `batch`'s prompts, cut into `pieces` micro-batches, scored; `shuffle`: their
        rows in an order drawn from `rng`, as TRL shuffles a round that serves several steps."""
        import torch

        from bigtrain.rollout.generation_batch import by_length
        clock = Clock(policy.device)
        rollout = self.completions(policy, batch, rng)
        self.times["generation"] = clock.lap()
        if self.agent is not None:  # the tools' seconds apart from the model's
            self.times["tools"] = getattr(rollout, "tool_seconds", 0.0)
            self.times["generation"] -= self.times["tools"]
        # scored and measured whole, as TRL does; a cut completion trains on nothing with mask_truncated_completions
        trained = rollout.masked_truncated() if getattr(self.settings, "mask_truncated_completions", False) \
            else rollout
        lengths = self.regrouping(trained, pieces)
        rows = trained.completion_ids.shape[0]
        cut = split_rollout(trained, pieces, None if lengths is None else by_length(
            torch.arange(rows, device=lengths.device), lengths, rows))
        self.reference_logps(policy, cut)
        self.times["reference"] = clock.lap()
        self.round_metrics = self.score_round(policy, batch, rollout, cut)
        self.round_metrics.update(self.completion_metrics(rollout))
        self.collapse.see(rollout.completion_ids, rollout.completion_mask, self.group, gather_rows)
        self.round_metrics.update(getattr(rollout, "metrics", {}))  # tools/* of a rollout with tools
        self.times["rewards"] = clock.lap()
        if shuffle:
            from bigtrain.rollout.generation_batch import shuffled
            with rng.active():
                order = torch.randperm(rows, device=rng.device).to(trained.completion_ids.device)
            if lengths is not None:  # each step's rows as drawn, its micro-batches by length
                order = by_length(order, lengths, rows // self.steps_per_round)
            place = torch.empty_like(order)  # where each of the rollout's rows is among the pieces' rows
            place[torch.cat([p.index for p in cut])] = torch.arange(rows, device=order.device)
            cut = shuffled(cut, place[order], len(cut))
        return cut

    def regrouping(self, rollout: Any, pieces: int) -> torch.Tensor | None:
        """The rows' lengths to group a round's micro-batches by, or None where they keep the rollout's order (one
        micro-batch, or a loss that depends on the split: `regroups`)."""
        from bigtrain.rollout.generation_batch import row_lengths
        if pieces == 1 or not self.regroups:
            return None
        return row_lengths(rollout.prompt_mask, rollout.completion_mask, getattr(rollout, "context_mask", None))

    def completions(self, policy: Policy, batch: dict, rng: Any) -> Any:
        """The round's completions (a `bigtrain.rollout.generate.Rollout`): sampled from the policy, num_generations
        per prompt, every rank together; a subclass may take them from elsewhere (distillation: the records'
        answers on some steps)."""
        gather = self.settings.ds3_gather_for_generation
        gather = None if gather == "auto" else gather
        if self.agent is not None:  # turns of calls and results, every rank in lockstep
            return self.agent.rollout(policy, batch["records"], self.sampling, rng, gather=gather)
        images = {"pixels": batch["pixels"]} if batch.get("pixels") is not None else {}
        return policy.generate(batch["prompt_ids"], batch["prompt_mask"], self.sampling, rng, gather=gather, **images)

    def reference_logps(self, policy: Policy, pieces: list[Piece]) -> None:
        import torch

        from bigtrain.rollout.losses import token_logps
        temperature = self.settings.temperature
        with torch.no_grad():
            for piece in pieces:
                if self.uses_old_logps:
                    piece.old_logps = token_logps(policy.completion_logits(*piece.rows), piece.completion_ids,
                                                  temperature).detach()
                if self.uses_reference:
                    piece.ref_logps = token_logps(policy.reference_completion_logits(*piece.rows),
                                                  piece.completion_ids, temperature)

    def completion_metrics(self, rollout: Any) -> Metrics:
        from bigtrain.rollout.metrics import completion_metrics
        lengths = gather_rows(rollout.completion_mask.sum(-1).float().unsqueeze(1), rollout.completion_mask.device)
        truncated = gather_rows(rollout.truncated.float().unsqueeze(1), rollout.completion_mask.device)
        return completion_metrics(lengths[:, 0], truncated[:, 0] > 0)

    def begin_step(self, policy: Policy, micro: list[Piece]) -> StepState:
        from bigtrain.rollout.losses import global_count
        world = _world()
        if self.steps_per_round > 1 and any(p is micro[0] for p in self.held):  # TRL: the round's over its steps
            if self.round_tokens is None:
                self.round_tokens = global_count([p.completion_mask for p in self.held])
            tokens = self.round_tokens / self.steps_per_round
        else:
            tokens = global_count([p.completion_mask for p in micro])
        return StepState(tokens, len(micro) * world, time.perf_counter())

    def micro_loss(self, policy: Policy, item: Piece, step: StepState) -> tuple[torch.Tensor, Metrics]:
        share = self.piece_loss(policy, item, step)
        return share * step.micro_batches, {}

    def end_step(self, policy: Policy, step: StepState) -> Metrics:
        from bigtrain.rollout.metrics import reduce_sums
        Clock(policy.device).sync()
        self.steps_done += 1
        self.collapse.step(self.steps_done, self.round_metrics.get("frac_reward_zero_std"))
        times = {**self.times, "policy": time.perf_counter() - step.started}
        return {**self.round_metrics, **reduce_sums(step.sums), **{f"time/{k}": v for k, v in times.items()}}

    def eval_loss(self, policy: Policy, item: dict) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
        """The loss of a round on held-out prompts (one micro-batch, no update: the ratio is 1) and its metrics,
        sampled from a stream of its own (saved with the checkpoint too), eval_group completions per prompt
        (TRL's num_generations_eval)."""
        import torch
        self.streams(policy)
        saved = self.times, self.table, self.round_metrics, self.collapse.identical
        with torch.no_grad(), self.evaluating():
            self.times = {}
            (piece,) = self.round(policy, item, 1, self.eval_rng)
            step = self.begin_step(policy, [piece])
            # a rank's loss as TRL's evaluation has it (the ranks' are then averaged, not summed): no share of a
            # step, and dapo's kind divides by the tokens of every rank over the ranks (num_items / processes)
            step.micro_batches, step.step_tokens = 1, step.step_tokens / _world()
            loss = self.piece_loss(policy, piece, step)
        metrics = {**self.round_metrics, **reduce_sums_local(step.sums)}
        self.times, self.table, self.round_metrics, self.collapse.identical = saved
        return loss, torch.ones((), dtype=torch.float64, device=loss.device), {
            k: torch.as_tensor(v, dtype=torch.float64, device=loss.device) for k, v in metrics.items()}

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        """Inside, a round samples and groups eval_group completions per prompt."""
        saved = self.group, self.sampling
        self.group, self.sampling = self.eval_group, self.eval_sampling
        try:
            yield
        finally:
            self.group, self.sampling = saved

    # -- state ---------------------------------------------------------------------------------------------------

    def streams(self, policy: Policy) -> None:
        """The training and evaluation streams of this rank, made from (train.seed, rank) at the first round, or
        as a checkpoint left them."""
        if self.rng is not None:
            return
        from bigtrain.rollout.generate import SampleRNG
        self.rng = SampleRNG(policy.seed, rank_here(), policy.device)
        self.eval_rng = SampleRNG(policy.seed + 1, rank_here(), policy.device)
        if self.pending is not None:
            self._apply(self.pending, policy.device)
            self.pending = None

    def state_dict(self) -> dict:
        """The random streams, and the round the next steps train on (num_iterations, steps_per_generation) with how
        far they are."""
        if self.rng is None:
            return dict(self.pending or {})
        state: dict = {"rng": self.rng.state_dict(), "eval_rng": self.eval_rng.state_dict(), "steps": self.steps_done}
        if self.held and self.iteration < self.iterations * self.steps_per_round:
            state.update(iteration=self.iteration, held=[p.state() for p in self.held],
                         round_metrics={k: float(v) for k, v in self.round_metrics.items()})
        return state

    def load_state_dict(self, state: dict) -> None:
        self.pending = dict(state)

    def _apply(self, state: dict, device: Any) -> None:
        self.rng.load_state_dict(state["rng"])
        self.eval_rng.load_state_dict(state["eval_rng"])
        self.steps_done = int(state.get("steps", 0))
        if "held" in state:
            self.iteration, self.round_metrics = int(state["iteration"]), dict(state["round_metrics"])
            from bigtrain.models.pixels import PixelInputs
            self.held = [Piece(**{k: PixelInputs.from_state(v).to(device) if k == "pixels" else v.to(device)
                                  for k, v in p.items()}) for p in state["held"]]

    def sample_table(self) -> list[dict] | None:
        table, self.table = self.table, None  # each round's rows once
        return table

    def window_warning(self) -> str | None:
        return self.collapse.line()

    def flops_factor(self) -> float:
        """Against the policy's 6N a token: generation's forward (2N a token, a third), the old policy's and the
        reference's forwards where the loss uses them, each once a round of num_iterations steps. Matmul FLOPs of
        the policy; the KV cache's attention and a reward model's forwards are not counted."""
        forwards = 1 + self.uses_old_logps + self.uses_reference
        return 1.0 + forwards / 3 / self.iterations


def _agent(settings: Any) -> Any:
    """The multi-turn round of objective.tools / objective.environment (their files imported now), or None."""
    if not settings.uses_tools:
        return None
    from bigtrain.rollout.agent import Agent
    from bigtrain.rollout.environments import Toolbox
    return Agent(Toolbox(settings.tools or [], settings.environments), settings.max_completion_length,
                 settings.max_tool_calling_iterations, settings.tool_timeout)


def rank_here() -> int:
    """This process's rank (0 without a process group)."""
    import torch
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _world() -> int:
    import torch
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
