"""Generation tokens/s for online RL, run by scripts/bench_online_rl.py through torchrun on 1 or 2 ranks:
the same prompts and lengths, greedy, decoded three ways in one process:

    plain        transformers' generate on the plain module (no DeepSpeed): the bound here
    gathered     bigtrain.rollout.generate on a ZeRO-3 engine, weights gathered once a round
                 (objective.ds3_gather_for_generation=true; DeepSpeed's unwrap_model_for_generation)
    partitioned  the same engine, weights left partitioned: each layer all-gathered at every decode step
                 (DeepSpeed's HybridEngineRollout; objective.ds3_gather_for_generation=false)

Usage: torchrun --nproc_per_node W bench_online_rl_generation.py OUT.json [--rounds 3] [--new 48] [--threads 1]

The global prompts are split between the ranks (rank r answers prompts r, r + W, ...), so 2 ranks decode half as
many rows each as 1 rank does. Every rank runs one thread (--threads): on a shared host two threads in one process
wait on each other at every operator (OpenMP), which turned one 8-prompt round from 1.3-2.2 s (2 processes of one
thread, 4 prompts each) into 19-27 s here at load 12-18, a measure of the host's load rather than of the ranks.
The end-of-text is an id that no prompt's greedy completion produces on the plain module (found by a first, untimed
round), so every mode decodes exactly `new` tokens for every prompt: the same work, and tokens that must be equal
(checked: a mode whose tokens differ from the plain module's makes the report say so). ZeRO-3 keeps no parameter
whole for being small (stage3_param_persistence_threshold 0), as none of a real model's layers is: every layer is
gathered. Each timed round runs between two barriers; its time is the slowest rank's. The modes alternate order
from round to round so that the host's drift hits each alike. Rank 0 writes OUT.json.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from types import SimpleNamespace

import deepspeed
import torch
from deepspeed import comm as dist

from bigtrain.rollout.generate import SampleRNG, Sampling, generate

SHAPE = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 704, "vocab_size": 2048}
PAD, PROMPTS, PROMPT_LENGTHS = 0, 8, (8, 24)
MODES = ("plain", "gathered", "partitioned")


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE, max_position_embeddings=256, pad_token_id=PAD, bos_token_id=1, eos_token_id=None)
    return LlamaForCausalLM(config).eval()


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    low, high = PROMPT_LENGTHS
    lengths = torch.randint(low, high + 1, (PROMPTS,), generator=g).tolist()
    return [torch.randint(2, SHAPE["vocab_size"], (n,), generator=g).tolist() for n in lengths]


def left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(rows):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    return ids, mask


def plain_generate(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, new: int,
                   eos: int | None) -> list[list[int]]:
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                             eos_token_id=eos, pad_token_id=PAD)
    return out[:, ids.shape[1]:].tolist()


def unused_id(rows: list[list[int]]) -> int:
    """The smallest id (past pad and bos) that no completion holds: an end-of-text no prompt reaches greedily."""
    seen = {t for row in rows for t in row}
    return next(t for t in range(2, SHAPE["vocab_size"]) if t not in seen)


def timed(fn) -> tuple[float, float, list[list[int]]]:
    """The slowest rank's wall seconds for `fn` between two barriers, the most CPU seconds a rank's process spent
    in it (all its threads: wall well above it means the rank waited, for the host's cores or for another rank),
    and this rank's tokens."""
    dist.barrier()
    started, cpu = time.perf_counter(), time.process_time()
    tokens = fn()
    seconds = torch.tensor([time.perf_counter() - started, time.process_time() - cpu], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds[0]), float(seconds[1]), tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads)
    plain = tiny_llama()
    mine = prompts()[rank::world]
    ids, mask = left_pad(mine)
    free_run = [None] * world
    dist.all_gather_object(free_run, plain_generate(plain, ids, mask, args.new, None))  # also the warm-up
    eos = unused_id([row for part in free_run for row in part])
    tokenizer = SimpleNamespace(pad_token_id=PAD, eos_token_id=eos, name_or_path="bench")
    config = {"train_batch_size": world, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    model = copy.deepcopy(plain).train()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    greedy = Sampling(max_new_tokens=args.new, temperature=0.0)

    def ours(gather: bool):
        return lambda: generate(engine, tokenizer, ids, mask, greedy, SampleRNG(0, rank, "cpu"),
                                gather=gather).completion_ids.tolist()

    runs = {"plain": lambda: plain_generate(plain, ids, mask, args.new, eos), "gathered": ours(True),
            "partitioned": ours(False)}
    seconds: dict[str, list[float]] = {m: [] for m in MODES}
    cpu_seconds: dict[str, list[float]] = {m: [] for m in MODES}
    tokens: dict[str, list] = {}
    for name in MODES:  # warm-up: the first round of each (allocations, DeepSpeed's first gathers)
        *_, tokens[name] = timed(runs[name])
    for r in range(args.rounds):
        for name in MODES if r % 2 == 0 else MODES[::-1]:
            s, cpu, got = timed(runs[name])
            seconds[name].append(s)
            cpu_seconds[name].append(cpu)
            assert got == tokens[name], f"{name}: greedy tokens changed between rounds"
    everyone = [None] * world
    dist.all_gather_object(everyone, tokens)
    if rank == 0:
        completions = world * len(mine) if PROMPTS % world == 0 else PROMPTS
        report = {"world": world, "threads_per_rank": torch.get_num_threads(), "prompts": PROMPTS,
                  "prompt_lengths": "%d-%d" % PROMPT_LENGTHS, "new_tokens": args.new, "rounds": args.rounds,
                  "shape": SHAPE, "eos": eos,
                  "tokens_per_round": completions * args.new,
                  "same_tokens_as_plain": {m: all(part[m] == part["plain"] for part in everyone) for m in MODES},
                  "all_full_length": all(len(row) == args.new for part in everyone for row in part["plain"]),
                  "seconds": seconds, "cpu_seconds": cpu_seconds,
                  "tokens_per_s": {m: completions * args.new / statistics.median(s) for m, s in seconds.items()}}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
