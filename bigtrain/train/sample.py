"""A short generated sample at the end of a run of a generative model (GPT-2, Llama, a causal Hugging Face
model; a classifier has none): the quickest proof that training worked.

It must never keep a finished run from exiting. Under ZeRO-3 every rank holds a slice of each
weight and the forward hooks all-gather them, so every rank runs `generate` in lockstep (HF's
`synced_gpus`: the same number of forwards on every rank, whatever each samples); rank 0
prints. A pipeline's stages each hold some layers: their weights are gathered into a plain
model on rank 0, outside DeepSpeed. ZeRO 0-2 keep whole weights on every rank: rank 0 alone
generates. The caller bounds the whole step (`Lifeline.bound`, bigtrain.distributed.lifeline). A chat or instruction run
answers a held-out prompt instead (`DataBundle.sample_prompt`: the conversation so far rendered by the
chat template, up to the assistant's generation prompt), shown with the template's markers. An objective that
generates its answers (online RL) samples as it trained: its own settings (`Objective.sample_settings`:
objective.max_completion_length, temperature, top_p, top_k) and end-of-text ids, not train.sample_tokens.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from bigtrain.distributed.world import World, barrier

log = logging.getLogger("bigtrain")
PROMPT = "The "
PIPELINE_SAMPLE_MAX_PARAMS = 2_000_000_000  # gathering a bigger pipeline model into one process is not worth a sample


@torch.no_grad()
def generate_sample(model: torch.nn.Module, tokenizer: Any, max_new_tokens: int, device: str,
                    prompt: str = PROMPT, synced: bool = False, prompt_ids: list[int] | None = None,
                    sampling: Any = None) -> str:
    """Top-k sampling with a fixed seed (the caller's RNG state is kept), so the sample is reproducible.

    `synced`: every rank calls this together (ZeRO-3), each forward being a collective. `prompt_ids`: token
    ids to continue instead of `prompt` (a held-out chat prompt), decoded with their special tokens. `sampling`: an
    objective's own (`bigtrain.rollout.generate.Sampling`), which then decides the length, the drawing and the
    end-of-text ids as in training, instead of `max_new_tokens` and top-k 40."""
    from bigtrain.rollout.generate import drawing, stop_ids
    if prompt_ids:
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    else:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(device)
    if sampling is not None:
        max_new_tokens, drawn, stops = sampling.max_new_tokens, drawing(sampling), stop_ids(model, tokenizer)
    else:
        drawn, stops = {"do_sample": True, "top_k": 40}, answer_stops(model, tokenizer) if prompt_ids else None
    limit = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    if limit:  # learned positions end there: generating past them fails
        max_new_tokens = max(1, min(max_new_tokens, limit - ids.shape[1]))
    generator_state = torch.get_rng_state()
    torch.manual_seed(0)
    padding = range(len(tokenizer), model.config.vocab_size)  # rows of a padded vocabulary (vocab_multiple)
    try:
        out = model.generate(ids, max_new_tokens=max_new_tokens, suppress_tokens=list(padding) or None,
                             synced_gpus=synced, eos_token_id=stops, **drawn,
                             pad_token_id=tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0)
    finally:
        torch.set_rng_state(generator_state)
    return tokenizer.decode(out[0], skip_special_tokens=not prompt_ids)


def answer_stops(model: torch.nn.Module, tokenizer: Any) -> list[int] | None:
    """Where a held-out prompt's answer ends: the model's end-of-text ids and the token its chat template closes a
    turn with (one turn, as `bigtrain generate` answers); None: the model's own."""
    from bigtrain.data.chat import turn_end_ids
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    stops = [eos] if isinstance(eos, int) else list(eos or [])
    stops += [i for i in turn_end_ids(tokenizer) if i not in stops and i < model.config.vocab_size]
    return stops or None


def print_sample(engine: Any, tokenizer: Any, max_new_tokens: int, world: World,
                 prompt_ids: list[int] | None = None) -> str | None:
    """Collective: every rank calls it. Returns the text on rank 0 (None elsewhere or without one)."""
    sampling = engine.objective.sample_settings()
    if engine.is_pipeline:
        text = _pipeline_sample(engine, tokenizer, max_new_tokens, world, prompt_ids)
    else:
        text = _module_sample(engine, tokenizer, max_new_tokens, world, prompt_ids, sampling)
    if text is not None and world.is_main:
        what = "the trained model answers a held-out prompt" if prompt_ids else "sample from the trained model"
        print(f"\n--- {what} ---\n{text}\n-------------------------------------", flush=True)
    return text if world.is_main else None


def _module_sample(engine: Any, tokenizer: Any, max_new_tokens: int, world: World,
                   prompt_ids: list[int] | None, sampling: Any = None) -> str | None:
    model = engine.module()
    if not hasattr(model, "generate"):
        return None
    was_training = model.training
    model.eval()
    try:
        # ZeRO-3 gathers weights and AutoTP all-reduces inside every forward: every rank must generate alike.
        tensor_parallel = engine.split is not None and engine.split.topology.tensor > 1
        if (engine.ds.zero_optimization_stage() == 3 or tensor_parallel) and world.size > 1:
            text = generate_sample(model, tokenizer, max_new_tokens, engine.device, synced=True, prompt_ids=prompt_ids,
                                   sampling=sampling)
        else:
            text = generate_sample(model, tokenizer, max_new_tokens, engine.device, prompt_ids=prompt_ids,
                                   sampling=sampling) if world.is_main else None
            barrier()
    finally:
        model.train(was_training)
    return text if world.is_main else None


def _pipeline_sample(engine: Any, tokenizer: Any, max_new_tokens: int, world: World,
                     prompt_ids: list[int] | None) -> str | None:
    """Each stage's layer weights to rank 0, into the plain model; the others wait at a barrier."""
    from bigtrain.models.pipeline_form import module_state_from_pipeline
    from bigtrain.parallel.pipeline import local_layer_states
    spec = engine.spec
    if spec.num_params > PIPELINE_SAMPLE_MAX_PARAMS:
        if world.is_main:
            log.info("no sample: gathering a %.1fB-parameter pipeline model into one process is not worth it",
                     spec.num_params / 1e9)
        return None
    local = {idx: {k: v.detach().float().cpu() for k, v in state.items()}
             for idx, state in local_layer_states(engine.module(), spec).items()}
    gathered: list[Any] = [None] * world.size
    torch.distributed.all_gather_object(gathered, local)
    text = None
    if world.is_main:
        layers = {idx: state for part in gathered for idx, state in part.items()}
        model = spec.build()
        if hasattr(model, "generate"):
            model.load_state_dict(module_state_from_pipeline(spec, layers), strict=False)
            model.float().eval()
            text = generate_sample(model, tokenizer, max_new_tokens, "cpu", prompt_ids=prompt_ids)
    barrier()
    return text
