"""Rollouts that call tools over several turns (objective.tools, objective.environment): TRL 1.16's
`_tool_call_loop`, with every rank in lockstep.

    agent = Agent(Toolbox(tools, environments), max_completion_length, max_iterations=None, timeout=60.0)
    rollout = agent.rollout(policy, records, sampling, rng, gather=None)     # an AgentRollout (a Rollout)

A round:
1. each rollout (num_generations per record) gets an environment instance of its own, reset with its record; its
   prompt (the record's messages, what reset returned appended) is rendered by the chat template with the
   rollout's tools (`tools=`: objective.tools and its environment's methods);
2. the model answers (one generation for every rollout); each answer is parsed (tool_format.py); the calls of the
   rollouts that made some are run (tools.py: side by side, each cut at objective.tool_timeout) and their results
   appended as `tool` messages, whose tokens are the template's suffix after the model's turn (the difference of
   two renders: the model's own tokens are never re-tokenized);
3. the rollouts that called go on from prompt + completion + suffix (one generation for them all), until none
   calls, objective.max_tool_calling_iterations rounds of calls have run, or the token budget (max_completion_length)
   is spent: a round of results that would pass it is dropped and the rollout ends with the turn that called (TRL's
   rollback), and a turn is cut to what is left.

The completion is every token after the prompt: the model's turns and the suffixes between them. Its
`completion_mask` marks the model's tokens alone (TRL's completion_mask x tool_mask): the loss of every loss type,
the step's token counts and the completion-length metrics see only those; `context_mask` marks them all, and the
forward passes (the policy's, the old policy's, the reference's, a teacher's) attend to all of them.

Lockstep. At ZeRO-3 every generation is collective (the weights gathered for it, or each decode step's layers
gathered when they stay partitioned), so a rank whose rollouts stopped calling must keep generating while another's
go on, or the job hangs (TRL decides the loop's length on each rank). After each round of calls the ranks agree,
in one all-reduce of two numbers, whether any rollout anywhere goes on and the most tokens any may still take;
every rank then generates with that budget (partitioned weights decode exactly so many steps on every rank), a
rank with none left generating one idle row whose tokens are dropped. So every rank runs the same turns and the
same decode steps, the most any rank needs.

Metrics (over every rank): tools/call_frequency (calls per rollout), tools/failure_frequency (failed calls per
call), tools/turns (the model's turns per rollout); `tool_seconds` is the time the round spent in the tools.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from bigtrain.rollout.environments import PLACEHOLDER_PROMPT, Toolbox, with_observation
from bigtrain.rollout.generate import Rollout
from bigtrain.rollout.tool_format import ToolFormat, template_problem
from bigtrain.rollout.tools import Call, run_calls


@dataclass
class AgentRollout(Rollout):
    """A Rollout whose completions hold the tools' results between the model's turns."""

    context_mask: torch.Tensor | None = None  # [N, C] 1 on every completion token (the model's and the results)
    prompts: list = field(default_factory=list)  # each rollout's prompt messages (reset's text appended)
    conversations: list = field(default_factory=list)  # each rollout's completion as messages (calls, results)
    environments: list = field(default_factory=list)  # each rollout's environment instance (None without)
    metrics: dict = field(default_factory=dict)  # tools/* over every rank
    tool_seconds: float = 0.0

    @property
    def lengths(self) -> torch.Tensor:
        return self.context_mask.sum(-1)

    def masked_truncated(self) -> "AgentRollout":
        keep = (~self.truncated).long().unsqueeze(1)
        return replace(self, completion_mask=self.completion_mask * keep, context_mask=self.context_mask * keep)


@dataclass
class _Row:
    """One rollout as it goes."""

    prompt: list[dict]
    prompt_ids: list[int]
    schemas: list[dict]
    callables: dict
    environment: Any
    ids: list[int] = field(default_factory=list)  # the completion so far: the model's turns and the suffixes
    model: list[int] = field(default_factory=list)  # 1 on the model's tokens
    messages: list[dict] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)  # its last turn's
    called: int = 0
    failed: int = 0
    turns: int = 0


class Agent:
    """The multi-turn round of an objective that generates with tools (see the module's docstring)."""

    def __init__(self, toolbox: Toolbox, max_completion_length: int, max_iterations: int | None, timeout: float):
        self.toolbox, self.budget = toolbox, max_completion_length
        self.max_iterations, self.timeout = max_iterations, timeout
        self.format: ToolFormat | None = None  # at the first round: the policy's tokenizer and stop ids

    def rollout(self, policy: Any, records: list[dict], sampling: Any, rng: Any,
                gather: bool | None = None) -> AgentRollout:
        tok = policy.tokenizer
        if self.format is None:
            if problem := template_problem(tok):
                raise ValueError(f"objective.tools / objective.environment: {problem}")
            self.format = ToolFormat(tok, policy.stop_ids())
        self.toolbox.check_records(records)
        n = sampling.num_generations
        expanded = [r for r in records for _ in range(n)]
        rows = [self._start(tok, record, env) for record, env in zip(expanded, self.toolbox.instances(expanded))]
        one = replace(sampling, num_generations=1)
        active, iteration, room, seconds = rows, 0, self.budget, 0.0
        while True:
            self._turn(policy, active, rows[0], replace(one, max_new_tokens=room), rng, gather)
            if self.max_iterations is not None and iteration >= self.max_iterations:
                break
            started = time.perf_counter()
            active = self._call(active)
            seconds += time.perf_counter() - started
            iteration += 1
            more, room = _agree(bool(active), max((self.budget - len(r.ids) for r in active), default=0), policy)
            if not more:
                break
        return self._rollout(tok, rows, policy, seconds)

    def _start(self, tok: Any, record: dict, environment: Any) -> _Row:
        prompt = record.get("prompt", PLACEHOLDER_PROMPT if self.toolbox.specs else None)
        if not isinstance(prompt, list) or not prompt:
            raise ValueError(f"objective.tools / objective.environment: a record's prompt is "
                             f"{type(prompt).__name__} {str(prompt)[:60]!r}; with tools the prompts are "
                             "conversations ([{\"role\": \"user\", \"content\": ...}]), which the chat template "
                             "renders with the tools")
        if environment is not None:
            prompt = with_observation(prompt, self.toolbox.reset(environment, record))
        schemas = self.toolbox.schemas(record)
        ids = tok.apply_chat_template(prompt, tools=schemas or None, add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        return _Row(prompt, ids, schemas, self.toolbox.callables(environment), environment)

    def _turn(self, policy: Any, rows: list[_Row], idle: _Row, sampling: Any, rng: Any, gather: bool | None) -> None:
        """One generation for every row going on (an idle row where this rank has none): each row's new turn
        appended (cut to what is left of the budget) and parsed."""
        contexts = [r.prompt_ids + r.ids for r in rows] or [idle.prompt_ids]
        ids, mask = _left_padded(contexts, _pad(policy.tokenizer), policy.device)
        out = policy.generate(ids, mask, sampling, rng, gather=gather)
        for row, turn in zip(rows, out.completion_lists()):
            before = row.prompt_ids + row.ids
            turn = turn[:self.budget - len(row.ids)]
            row.ids += turn
            row.model += [1] * len(turn)
            row.turns += 1
            message, row.calls = self.format.parse(turn, before, row.schemas)
            row.messages.append(message)

    def _call(self, rows: list[_Row]) -> list[_Row]:
        """The calls of the rows that made some, run; their results appended where the budget has room for them
        (with room left for a turn, the row goes on: returned)."""
        calling = [r for r in rows if r.calls]
        results = run_calls([r.calls for r in calling], [r.callables for r in calling], self.timeout)
        going = []
        for row, answers in zip(calling, results):
            row.called += len(answers)
            row.failed += sum(a.failed for a in answers)
            messages = [a.message() for a in answers]
            suffix = self.format.suffix(messages)
            if len(row.ids) + len(suffix) > self.budget:
                continue  # TRL's rollback: the results dropped, the rollout ends with the turn that called
            row.ids += suffix
            row.model += [0] * len(suffix)
            row.messages += messages
            if len(row.ids) < self.budget:
                going.append(row)
        return going

    def _rollout(self, tok: Any, rows: list[_Row], policy: Any, seconds: float) -> AgentRollout:
        pad = _pad(tok)
        device = policy.device
        prompt_ids, prompt_mask = _left_padded([r.prompt_ids for r in rows], pad, device)
        width = max(1, max(len(r.ids) for r in rows))
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        model = torch.zeros((len(rows), width), dtype=torch.long)
        context = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row.ids)] = torch.tensor(row.ids, dtype=torch.long)
            model[i, :len(row.ids)] = torch.tensor(row.model, dtype=torch.long)
            context[i, :len(row.ids)] = 1
        ended = set(self.format.stops) | {pad}
        truncated = torch.tensor([not r.ids or r.ids[-1] not in ended for r in rows], device=device)  # TRL's rule
        return AgentRollout(prompt_ids, prompt_mask, ids.to(device), model.to(device), truncated,
                            context_mask=context.to(device), prompts=[r.prompt for r in rows],
                            conversations=[r.messages for r in rows], environments=[r.environment for r in rows],
                            metrics=_metrics(rows, device), tool_seconds=seconds)


def _agree(going: bool, room: int, policy: Any) -> tuple[bool, int]:
    """Whether any rank's rollouts go on, and the most tokens any may still take (every rank alike)."""
    value = torch.tensor([int(going), room], dtype=torch.long, device=policy.device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value[0]), int(value[1])


def _metrics(rows: list[_Row], device: Any) -> dict[str, float]:
    from bigtrain.distributed.world import sum_over_ranks
    sums = sum_over_ranks({"calls": float(sum(r.called for r in rows)), "failures": float(sum(r.failed for r in rows)),
                           "turns": float(sum(r.turns for r in rows)), "rows": float(len(rows))}, device)
    return {"tools/call_frequency": sums["calls"] / sums["rows"],
            "tools/failure_frequency": sums["failures"] / sums["calls"] if sums["calls"] else 0.0,
            "tools/turns": sums["turns"] / sums["rows"]}


def _pad(tok: Any) -> int:
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def _left_padded(rows: list[list[int]], pad: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max(map(len, rows)))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row):] = 1
    return ids.to(device), mask.to(device)
