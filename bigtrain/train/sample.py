"""A short generated sample at the end of a GPT-2 run: the quickest proof that training worked."""
from __future__ import annotations

import contextlib
import logging
from typing import Any

import deepspeed
import torch

from bigtrain.distributed.world import World, barrier

log = logging.getLogger("bigtrain")
PROMPT = "The "


@torch.no_grad()
def generate_sample(model: torch.nn.Module, tokenizer: Any, max_new_tokens: int, device: str,
                    prompt: str = PROMPT) -> str:
    """Top-k sampling with a fixed seed (the caller's RNG state is kept), so the sample is reproducible."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(device)
    generator_state = torch.get_rng_state()
    torch.manual_seed(0)
    padding = range(len(tokenizer), model.config.vocab_size)  # rows of a padded vocabulary (vocab_multiple)
    try:
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=True, top_k=40,
                             suppress_tokens=list(padding) or None,
                             pad_token_id=tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0)
    finally:
        torch.set_rng_state(generator_state)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def print_sample(engine: Any, tokenizer: Any, max_new_tokens: int, world: World) -> None:
    """Collective under ZeRO-3 (parameters are gathered); pipelines print nothing (stages are split)."""
    if engine.is_pipeline or not hasattr(engine.module(), "generate"):
        return
    model = engine.module()
    was_training = model.training
    model.eval()
    gather = engine.ds.zero_optimization_stage() == 3
    context = deepspeed.zero.GatheredParameters(list(model.parameters())) if gather else contextlib.nullcontext()
    with context:
        if world.is_main:
            text = generate_sample(model, tokenizer, max_new_tokens, engine.device)
            print(f"\n--- sample from the trained model ---\n{text}\n-------------------------------------",
                  flush=True)
    barrier()
    model.train(was_training)

