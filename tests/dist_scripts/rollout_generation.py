"""Run by tests/dist/test_rollout_generation.py on 1 or 2 ranks (tests/launch.py: launch_ranks): bigtrain.rollout.generate on
DeepSpeed engines that this script makes itself (deepspeed.initialize on a tiny Llama), one launch for every mode.

Usage: rollout_generation.py OUT_DIR
Rank 0 writes OUT_DIR/world{W}.json:
  "reference"   each prompt's greedy completion by transformers' generate on the plain module, alone (no padding)
                and its per-token log-probs from generate's scores (the KV-cached decode, not our forward)
  "eos"         the end-of-text id chosen so that prompt 0 (rank 0's first) ends after 2 tokens while the last
                prompt (rank 1's, with 2 ranks) never does: the ranks finish at different lengths
  "modes"       {"zero0", "zero3_gathered", "zero3_partitioned"}: {"greedy": each prompt's tokens (masked),
                "logps": their log-probs, "truncated": flags, "sampled": {"first", "again", "second",
                "second_restored"}: each prompt's 2 sampled completions in two rounds from one seed, the first
                round again from a fresh generator of the same seed, and the second round again from the
                generator state saved after the first, "first_padded": the first round with objective.decode=
                generate}, "seconds": the greedy round's time, "forwards": each
                rank's forward calls in it (decode steps + the log-probs' forward)}
"""
from __future__ import annotations

import copy
import json
import os
import sys
import time
from dataclasses import replace
from types import SimpleNamespace

import deepspeed
import torch
from deepspeed import comm as dist

from bigtrain.rollout.generate import SampleRNG, Sampling, generate

VOCAB, PAD, NEW = 128, 0, 8
# prompts 0 and 2 (rank 0's, with 2 ranks) are the same: both end after 2 tokens, while 1 and 3 (rank 1's) never do
PROMPTS = [[5, 9, 17], [33, 2, 71, 40, 8], [5, 9, 17], [12, 60, 61, 3, 44, 101]]


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, pad_token_id=PAD, bos_token_id=1, eos_token_id=None)
    return LlamaForCausalLM(config).eval()


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    return ids, mask


@torch.no_grad()
def plain_greedy(model: torch.nn.Module, eos: int | None) -> list[dict]:
    """transformers' generate on the plain module, each prompt alone: tokens up to the end-of-text, and the
    log-probs of the chosen tokens from generate's own scores."""
    out = []
    for prompt in PROMPTS:
        result = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                                pad_token_id=PAD, output_scores=True, return_dict_in_generate=True)
        tokens = result.sequences[0, len(prompt):].tolist()
        logps = [torch.log_softmax(s[0].double(), -1)[t].item() for s, t in zip(result.scores, tokens)]
        cut = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        out.append({"tokens": tokens[:cut], "logps": logps[:cut]})
    return out


def choose_eos(free_run: list[dict]) -> int:
    """A token that prompt 0's greedy completion produces second (not first) and prompts 1 and 3 never do."""
    token = free_run[0]["tokens"][1]
    assert token != free_run[0]["tokens"][0] and all(token not in free_run[i]["tokens"] for i in (1, 3)), free_run
    return token


def ds_config(stage: int, world: int) -> dict:
    return {"train_batch_size": world, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            # no parameter kept whole for being small: every layer's weights are gathered at every forward
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, "steps_per_print": 10**6,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}


def run_mode(plain: torch.nn.Module, stage: int, gather: bool, tokenizer, rank: int, world: int) -> dict:
    model = copy.deepcopy(plain).train()  # generation must put it in eval mode itself
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(stage, world))
    mine = list(range(rank, len(PROMPTS), world))
    ids, mask = left_pad([PROMPTS[i] for i in mine])
    forwards = []
    hook = engine.module.register_forward_hook(lambda *args: forwards.append(1))
    started = time.perf_counter()
    greedy = generate(engine, tokenizer, ids, mask, Sampling(max_new_tokens=NEW, temperature=0.0), SampleRNG(0, rank,
                      "cpu"), gather=gather, logps=True)
    seconds = time.perf_counter() - started
    hook.remove()
    assert engine.module.training, "generation left the policy in eval mode"
    sampling = Sampling(max_new_tokens=NEW, temperature=1.0, top_k=50, num_generations=2)
    rng = SampleRNG(7, rank, "cpu")
    first = generate(engine, tokenizer, ids, mask, sampling, rng, gather=gather)
    saved = rng.state_dict()
    second = generate(engine, tokenizer, ids, mask, sampling, rng, gather=gather)
    again = generate(engine, tokenizer, ids, mask, sampling, SampleRNG(7, rank, "cpu"), gather=gather)
    restored = SampleRNG(123, rank, "cpu")
    restored.load_state_dict(saved)
    second_restored = generate(engine, tokenizer, ids, mask, sampling, restored, gather=gather)
    padded = generate(engine, tokenizer, ids, mask, replace(sampling, decode="generate"), SampleRNG(7, rank, "cpu"),
                      gather=gather)
    lengths = greedy.lengths.tolist()
    local = {"forwards": len(forwards), "prompts": mine, "greedy": greedy.completion_lists(),
             "truncated": greedy.truncated.tolist(),
             "logps": [row[:n].tolist() for row, n in zip(greedy.logps, lengths)],
             "sampled": {name: r.completion_lists() for name, r in (("first", first), ("again", again),
                                                                    ("second", second),
                                                                    ("second_restored", second_restored),
                                                                    ("first_padded", padded))}}
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    merged: dict = {"greedy": [None] * len(PROMPTS), "logps": [None] * len(PROMPTS),
                    "truncated": [None] * len(PROMPTS), "sampled": {k: [None] * len(PROMPTS) for k in local["sampled"]},
                    "seconds": seconds, "forwards": [part["forwards"] for part in gathered]}
    for part in gathered:
        for j, i in enumerate(part["prompts"]):
            for key in ("greedy", "logps", "truncated"):
                merged[key][i] = part[key][j]
            for name, rows in part["sampled"].items():
                merged["sampled"][name][i] = rows[2 * j:2 * j + 2]
    return merged


def main() -> None:
    (out_dir,) = sys.argv[1:]
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    plain = tiny_llama()
    eos = choose_eos(plain_greedy(plain, None))
    tokenizer = SimpleNamespace(pad_token_id=PAD, eos_token_id=eos, name_or_path="test")  # pad != end-of-text
    report = {"world": world, "eos": eos, "reference": plain_greedy(plain, eos), "modes": {}}
    for name, stage, gather in (("zero0", 0, False), ("zero3_gathered", 3, True), ("zero3_partitioned", 3, False)):
        report["modes"][name] = run_mode(plain, stage, gather, tokenizer, rank, world)
    if rank == 0:
        with open(os.path.join(out_dir, f"world{world}.json"), "w") as f:
            json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
