"""Run by tests/dist/test_online_rl.py on its ranks (tests/launch.py: launch_jobs): runner jobs one after another
in one launch, as tests/dist_scripts/equiv_runs.py runs them (its `run_one`), and for a job marked "fixed": true,
with the completions fixed instead of sampled.

Fixed completions bypass generation (`PolicyModel.generate` replaced for the job): each prompt of generation round
k gets num_generations completions drawn from a generator seeded by (the prompt's tokens, k) alone, so that one
process and two ranks, whichever rank a prompt lands on, train on the same completions. A completion starts with
the prompt's own last token (its answer in tests/rl_task.py's task) half of the time, so that rewards differ within
a group, and ends with the end-of-text or is cut at max_new_tokens. Each rank writes what it returned to
ROOT/NAME/fixed_rank{R}.jsonl (one line a round: the prompts' tokens, the completions' tokens and masks, which
were cut), for the test to hand the same batches to the plain loop (tests/grpo_reference.py).

Usage: online_rl_runs.py ROOT PLAN.json (the plan as equiv_runs.py's).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import equiv_runs  # noqa: E402

from bigtrain.distributed.world import init_distributed, shutdown  # noqa: E402
from bigtrain.rollout.generate import Rollout  # noqa: E402
from bigtrain.train.policy import PolicyModel  # noqa: E402
from bigtrain.train.process import setup_logging  # noqa: E402

WORDS = (4, *range(8, 18), 18)  # "the", the digits, "a" of tests/rl_task.py's vocabulary


def fixed_completions(prompt: list[int], k: int, n: int, width: int, eos: int) -> list[tuple[list[int], bool]]:
    """(tokens, cut) of the `n` completions of `prompt` in round `k`: the same on every rank."""
    g = torch.Generator().manual_seed(hash((tuple(prompt), k)) % (1 << 31))
    out = []
    for _ in range(n):
        cut = float(torch.rand((), generator=g)) < 0.3
        length = width if cut else int(torch.randint(1, width + 1, (1,), generator=g))
        tokens = [WORDS[int(i)] for i in torch.randint(0, len(WORDS), (length,), generator=g)]
        if float(torch.rand((), generator=g)) < 0.5:
            tokens[0] = prompt[-1]
        if not cut:
            tokens[-1] = eos
        out.append((tokens, cut))
    return out


def fixed_generate(log: Path):
    rounds = iter(range(1, 1 << 30))

    def generate(self, prompt_ids, prompt_mask, sampling, rng, *, gather=None, logps=False):
        k, n, width = next(rounds), sampling.num_generations, sampling.max_new_tokens
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        prompts = [row[m.bool()].tolist() for row, m in zip(prompt_ids, prompt_mask)]
        made = [c for p in prompts for c in fixed_completions(p, k, n, width, eos)]
        ids = torch.full((len(made), width), pad, dtype=torch.long)
        mask = torch.zeros((len(made), width), dtype=torch.long)
        for i, (tokens, _) in enumerate(made):
            ids[i, :len(tokens)], mask[i, :len(tokens)] = torch.tensor(tokens), 1
        cut = torch.tensor([c for _, c in made])
        with log.open("a") as f:
            f.write(json.dumps({"round": k, "prompts": prompts, "completions": [t for t, _ in made],
                                "cut": cut.tolist()}) + "\n")
        device = prompt_ids.device
        return Rollout(prompt_ids.repeat_interleave(n, 0), prompt_mask.repeat_interleave(n, 0), ids.to(device),
                       mask.to(device), cut.to(device))

    return generate


def main() -> None:
    root, plan = [Path(a) for a in sys.argv[1:] if not a.startswith("--local_rank")]
    world = init_distributed()
    setup_logging(world)
    sampled = PolicyModel.generate
    for job in json.loads(plan.read_text()):
        if job.get("fixed"):
            (root / job["name"]).mkdir(parents=True, exist_ok=True)
            PolicyModel.generate = fixed_generate(root / job["name"] / f"fixed_rank{world.rank}.jsonl")
        try:
            equiv_runs.run_one(root, job, world)
        finally:
            PolicyModel.generate = sampled
    shutdown()


if __name__ == "__main__":
    main()
