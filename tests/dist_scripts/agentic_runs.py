"""Run by tests/dist/test_agentic_rl.py on its ranks (tests/launch.py: launch_jobs): runner jobs one after another
in one launch, as tests/dist_scripts/equiv_runs.py runs them (its `run_one`). For a job marked "scripted": true the
model's turns are tests/tool_task.py's scripted model (calls and answers decided by the context alone, the same on
any rank), given after the real generation on the engine's module has run and its tokens were dropped: at ZeRO-3 its
collectives (the weights gathered once a call; left partitioned, each decode step's layers, over a number of steps
that follows the budget the ranks agreed on) run as in a real round, so a rank that left the turns early would leave
the other waiting there, as a real run would hang.

Each rank writes ROOT/NAME/rounds_rank{R}.jsonl, one line a round: every rollout's prompt and completion tokens, the
mask of the model's tokens, its conversation, its box and the code in it; and ROOT/NAME/turns_rank{R}.jsonl, one
line a round: how many rollouts each turn of this rank generated for (0: the idle row of a rank with none left).

A job {"name", "generate": [flags]} runs `bigtrain generate`'s rank instead (generate_with_tools).

Usage: agentic_runs.py ROOT PLAN.json (the plan as equiv_runs.py's).
"""
from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Iterator

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))

import equiv_runs  # noqa: E402
import tool_task  # noqa: E402

from bigtrain.distributed.world import init_distributed, shutdown  # noqa: E402
from bigtrain.rollout.agent import Agent  # noqa: E402
from bigtrain.train.policy import PolicyModel  # noqa: E402
from bigtrain.train.process import setup_logging  # noqa: E402


@contextmanager
def scripted(folder: Path, rank: int, world: int) -> Iterator[None]:
    real, rollout, turn = PolicyModel.generate, Agent.rollout, Agent._turn
    turns: list[int] = []

    def generate(self, prompt_ids, prompt_mask, sampling, rng, *, gather=None, logps=False):
        if world > 1:  # the collectives of a real round (one process has none to keep): with the weights gathered,
            # one gather a call, so one token does; left partitioned, a gather every decode step: as many steps as a
            # function of the budget the ranks agreed on (fewer than it, for time), so that ranks which disagreed
            # on it would wait on each other's gathers
            steps = 1 if gather is not False else 1 + sampling.max_new_tokens % 7
            real(self, prompt_ids, prompt_mask, replace(sampling, max_new_tokens=steps), rng, gather=gather)
        return tool_task.scripted_generate(self.tokenizer, prompt_ids, prompt_mask, sampling)

    def counted_turn(self, policy, rows, idle, sampling, rng, gather):
        turns.append(len(rows))
        return turn(self, policy, rows, idle, sampling, rng, gather)

    def logged_rollout(self, policy, records, sampling, rng, gather=None):
        out = rollout(self, policy, records, sampling, rng, gather=gather)
        rows = []
        for i in range(out.completion_ids.shape[0]):
            length = int(out.context_mask[i].sum())
            rows.append({"prompt": out.prompt_ids[i][out.prompt_mask[i].bool()].tolist(),
                         "completion": out.completion_ids[i, :length].tolist(),
                         "model": out.completion_mask[i, :length].tolist(), "conversation": out.conversations[i],
                         "box": out.environments[i].box, "code": out.environments[i].code,
                         "truncated": bool(out.truncated[i])})
        folder.mkdir(parents=True, exist_ok=True)
        with (folder / f"rounds_rank{rank}.jsonl").open("a") as f:
            f.write(json.dumps(rows) + "\n")
        with (folder / f"turns_rank{rank}.jsonl").open("a") as f:
            f.write(json.dumps(turns) + "\n")
        turns.clear()
        return out

    PolicyModel.generate, Agent.rollout, Agent._turn = generate, logged_rollout, counted_turn
    try:
        yield
    finally:
        PolicyModel.generate, Agent.rollout, Agent._turn = real, rollout, turn


def generate_with_tools(root: Path, job: dict, world) -> None:
    """`bigtrain generate --zero3`'s rank (bigtrain.generate.command.run_generate) with job["generate"] as its flags,
    the model's turns scripted: a call of `whose` until a result came back, then that result as the answer. Each
    rank writes ROOT/NAME/prompts_rank{R}.json: the prompts it generated from (the tools' results in them)."""
    import re

    from bigtrain.generate import command
    from bigtrain.generate.flags import build_rank_parser
    seen: list[str] = []

    def turn(model, tokenizer, ids, sampling, config, synced=False, streamer=None, extra=None):
        seen.append(tokenizer.decode(ids))
        results = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", seen[-1], re.DOTALL)
        text = results[-1] if results else '<tool_call>{"name": "whose", "arguments": {}}</tool_call>'
        return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]

    real, command.generate = command.generate, turn
    try:
        assert command.run_generate(build_rank_parser().parse_args(job["generate"]), world) == 0
    finally:
        command.generate = real
    folder = root / job["name"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"prompts_rank{world.rank}.json").write_text(json.dumps(seen))


def main() -> None:
    root, plan = [Path(a) for a in sys.argv[1:] if not a.startswith("--local_rank")]
    world = init_distributed()
    setup_logging(world)
    for job in json.loads(plan.read_text()):
        if "generate" in job:
            generate_with_tools(root, job, world)
        elif job.get("scripted"):
            with scripted(root / job["name"], world.rank, world.size):
                equiv_runs.run_one(root, job, world)
        else:
            equiv_runs.run_one(root, job, world)
    shutdown()


if __name__ == "__main__":
    main()
