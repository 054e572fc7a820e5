"""Tools in `bigtrain generate` and `bigtrain chat` (--tools, --environment): the functions and environment online RL
trained with (objective.tools, objective.environment), shown to the model through its chat template, its calls run
and their results given back, until it answers without calling (at most MAX_ROUNDS rounds of calls an answer).

The calls are read and run as a training rollout reads and runs them (bigtrain.rollout: tool_format, tools): a call
that fails answers the model with its error. On several ranks (--zero3) rank 0 runs the tools and the others take
its results, so every rank continues from the same conversation.
"""
from __future__ import annotations

import argparse
import json
from typing import Any, Callable

MAX_ROUNDS = 8
TIMEOUT_S = 60.0


def add_tool_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tools", action="append", default=[], metavar="FILE.py:FUNCTION",
                   help="a function the model may call (path/to/file.py:function or package.module:function; "
                        "repeatable), as objective.tools trains with")
    p.add_argument("--environment", default=None, metavar="FILE.py:CLASS",
                   help="an environment whose public methods the model may call (reset() with no argument at the "
                        "start and at /reset), as objective.environment trains with")


class Tooling:
    """The tools of a generation session: their schemas for the template, and the rounds of calls of an answer."""

    def __init__(self, args: argparse.Namespace, tokenizer: Any, stops: list[int]):
        from bigtrain.rollout.environments import Toolbox
        from bigtrain.rollout.tool_format import ToolFormat, template_problem
        self.toolbox = Toolbox(args.tools, {None: args.environment} if args.environment else None,
                               ("--tools", "--environment"))
        if problem := template_problem(tokenizer):
            raise ValueError(f"--tools / --environment: {problem}")
        self.format = ToolFormat(tokenizer, stops or [tokenizer.eos_token_id])
        self.environment = self.toolbox.instances([{}])[0]
        self.reset()

    @property
    def schemas(self) -> list[dict]:
        return self.toolbox.schemas({})

    def reset(self) -> None:
        """A new conversation: the environment reset with no record."""
        if self.environment is None:
            return
        try:
            self.environment.reset()
        except TypeError as e:
            raise ValueError(f"--environment {self.toolbox.specs[None]}: reset() without a record raised {e}; give "
                             "its parameters defaults to chat with it") from None

    def answer(self, messages: list[dict], generate: Callable[[list[dict]], tuple[list[int], list[int]]],
               say: Callable[[str], None], world: Any) -> list[dict]:
        """The messages an answer adds to `messages`: the model's turns and the tools' results, until a turn that
        calls nothing. `generate(messages)` -> (the prompt's ids, the new ids)."""
        from bigtrain.rollout.tools import run_calls
        added: list[dict] = []
        for _ in range(MAX_ROUNDS):
            prompt, new = generate(messages + added)
            message, calls = self.format.parse(new, prompt, self.schemas)
            added.append(message)
            if not calls:
                break
            results = _on_rank0(world, lambda: [[r.message() for r in run_calls(
                [calls], [self.toolbox.callables(self.environment)], TIMEOUT_S)[0]]])
            for result in results[0]:
                say(f"[{result['name']}] {result['content']}")
            added += results[0]
        return added


def _on_rank0(world: Any, produce: Callable[[], Any]) -> Any:
    """`produce()` run on rank 0, its (JSON) value on every rank."""
    if world.size == 1:
        return produce()
    from bigtrain.distributed.patient import from_rank0
    return json.loads(from_rank0((lambda: json.dumps(produce(), default=str)) if world.is_main else None))
