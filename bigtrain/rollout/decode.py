"""A round's completions decoded without paying for the ones that have ended (objective.decode=compact).

transformers' `generate` decodes every row of the batch until the longest completion ends: a row that drew its
end-of-text keeps running the model (on padding) at every later step. Here a row that ended leaves the batch, and
its keys and values leave the KV cache (`DynamicCache.batch_select_indices`, what DeepSpeed's
`runtime.rollout.ContinuousBatchScheduler` calls compacting the cache to the surviving slots): each decode step
runs on the rows still decoding only. A round's requests all start together, so no row is admitted later; the
prompts' prefill is generate's (left padding, position ids counting the real tokens).

Sampling is generate's: the same logits warpers (temperature, then top-k, then top-p: transformers' own classes,
in generate's order), softmax in fp32 and one `torch.multinomial` draw per row and step from the device's default
generator (greedy: argmax). So under the same seed the completions are generate's exactly until the first row
ends; after that the remaining rows draw from a smaller batch, so the draws differ but each completion is a
sample of the same distribution (greedy decoding stays generate's to the end: tests/unit/test_rollout_decode.py).

With ZeRO-3's weights left partitioned every forward all-gathers each layer on every rank together, so a rank may
not stop on its own (DeepSpeed issue 8262: the others would wait in the gather for ever). `synced`: the ranks decode
in step until every rank's completions have ended (one all-reduce of a flag a step); a rank whose own have all
ended keeps one of its rows as a placeholder, whose steps it runs and discards, drawing nothing. DeepSpeed's
HybridEngineRollout instead decodes max_new_tokens steps on every rank, each on every row.
"""
from __future__ import annotations

from typing import Any

import torch


def warpers(temperature: float, top_k: int, top_p: float) -> list[Any]:
    """transformers' logits warpers for these settings, in generate's order (none for greedy decoding)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    out: list[Any] = []
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if top_k:
        out.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        out.append(TopPLogitsWarper(top_p))
    return out


def compact_decode(module: Any, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, stops: list[int],
                   pad: int, *, greedy: bool, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                   takes_logits_to_keep: bool = True, cache_keyword: str = "cache", synced: bool = False) -> torch.Tensor:
    """[N, max_new_tokens] completion ids for the left-padded `ids` / `mask` ([N, P]): each row's tokens up to and
    including its first stop id, `pad` after it. `module`: a causal LM called like transformers' (a plain or
    peft model, or an engine's module with its weights whole); `cache_keyword`: the name its forward takes the KV
    cache by (transformers 5.24 renamed past_key_values to cache); `synced`: every rank calls this together and they
    decode in step (partitioned weights, the module's docstring)."""
    from transformers import DynamicCache
    config = getattr(module, "config", None)
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    steps = warpers(temperature, top_k, top_p) if not greedy else []
    stop = torch.tensor(stops, device=ids.device)
    out = torch.full((ids.shape[0], max_new_tokens), pad, dtype=ids.dtype, device=ids.device)
    positions = mask.long().cumsum(-1) - 1
    positions = positions.masked_fill(mask == 0, 1)  # generate's numbering: padding at 1, never attended
    extra = {"logits_to_keep": 1} if takes_logits_to_keep else {}
    logits = module(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                    **{cache_keyword: cache}, **extra).logits[:, -1].float()
    rows = torch.arange(ids.shape[0], device=ids.device)  # which of the round's rows each batch row is
    last, idle = positions[:, -1], False  # idle: this rank's rows have all ended (synced: a placeholder runs)
    for step in range(max_new_tokens):
        if not idle:
            for warp in steps:
                logits = warp(None, logits)
            chosen = logits.argmax(-1) if greedy else torch.multinomial(torch.softmax(logits, -1), 1).squeeze(1)
            out[rows, step] = chosen
        if step == max_new_tokens - 1:
            break
        going = ~torch.isin(chosen, stop) if not idle else torch.ones_like(chosen, dtype=torch.bool)
        if not bool(going.all()):
            keep = going.nonzero().squeeze(1)
            if keep.numel() == 0:
                if not synced:
                    break
                idle, keep = True, keep.new_zeros(1)  # an ended row decodes on, its steps discarded
            cache.batch_select_indices(keep)
            rows, mask, chosen, last = rows[keep], mask[keep], chosen[keep], last[keep]
        if synced and not _anyone_decoding(not idle, ids.device):
            break
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        last = last + 1
        logits = module(input_ids=chosen.unsqueeze(1), attention_mask=mask, position_ids=last.unsqueeze(1),
                        use_cache=True, **{cache_keyword: cache}).logits[:, -1].float()
    return out


def _anyone_decoding(mine: bool, device: torch.device) -> bool:
    """Whether any rank still has a completion going (a collective: every rank asks at every step)."""
    flag = torch.tensor([1 if mine else 0], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())
