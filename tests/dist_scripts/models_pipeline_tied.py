"""Part of models_dist_checks.py (2 ranks): GPT-2 as 2 pipeline stages.

Every rank builds the same plain GPT-2 (seed 0) and computes the reference: the mean loss
over two micro-batches, and the weights after one SGD step on it. Then, with activation
checkpoint interval 0 and 1, the spec becomes a 2-stage PipelineModule loaded with the
plain weights; one `eval_batch` and one `train_batch` run, and `check()` returns
the losses and this rank's layers' distance to the reference weights (the tied token
embedding lives on both stages).
"""
from __future__ import annotations

import deepspeed
import torch

from bigtrain.models import build, module_state_from_pipeline
from bigtrain.models.pipeline_form import first_tied_layers
from bigtrain.parallel import load_pipeline_state, to_pipeline_module

LR = 0.5
CONFIG = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
          "gradient_clipping": 0.0, "zero_optimization": {"stage": 0}, "steps_per_print": 1000}


def reference(spec, micro: list[torch.Tensor]) -> tuple[dict, float, dict]:
    torch.manual_seed(0)
    plain = spec.build()
    start = {k: v.clone() for k, v in plain.state_dict().items()}
    loss = sum(spec.loss(plain(x), x) for x in micro) / len(micro)
    loss.backward()
    stepped = {n: (p - LR * p.grad).detach() for n, p in plain.named_parameters()}
    stepped["lm_head.weight"] = stepped["transformer.wte.weight"]
    return start, loss.item(), stepped


def local_layer_states(pipe, spec) -> dict[int, dict[str, torch.Tensor]]:
    """This stage's layers, keyed by global layer index (tied modules under their owner's index)."""
    states = {int(k): m.state_dict() for k, m in pipe._modules.items() if k.isdigit()}
    for key, idx in first_tied_layers(spec.layers()).items():
        if key in pipe.tied_modules:
            states[idx] = pipe.tied_modules[key].state_dict()
    return states


def run_pipeline(spec, start: dict, micro: list[torch.Tensor], stepped: dict, interval: int) -> dict:
    pipe = to_pipeline_module(spec, num_stages=2, activation_checkpoint_interval=interval, seed=7)
    load_pipeline_state(pipe, spec, start)
    engine, *_ = deepspeed.initialize(model=pipe, optimizer=torch.optim.SGD(pipe.parameters(), lr=LR), config=CONFIG)
    eval_loss = engine.eval_batch(iter([(x, x) for x in micro]))
    train_loss = engine.train_batch(iter([(x, x) for x in micro]))
    after = module_state_from_pipeline(spec, local_layer_states(pipe, spec))
    diffs = {n: (t - stepped[n]).abs().max().item() for n, t in after.items() if n in stepped}
    return {
        "stage": pipe.stage_id, "parts": [int(p) for p in pipe.parts], "eval_loss": float(eval_loss),
        "train_loss": float(train_loss), "max_weight_diff": max(diffs.values()),
        "names": sorted(diffs), "has_tied_wte": "wte" in pipe.tied_modules,
        "checkpointed_segments": sum(pipe.is_checkpointable_results) if interval else 0,
        "start_diff": max((after[n] - start[n]).abs().max().item() for n in diffs),
    }


def check() -> dict:
    spec = build("gpt2", "tiny", vocab_size=256, n_layer=4)
    gen = torch.Generator().manual_seed(1)
    micro = [torch.randint(0, 256, (2, 16), generator=gen) for _ in range(2)]
    start, ref_loss, stepped = reference(spec, micro)
    return {"reference_loss": ref_loss, "runs": {str(i): run_pipeline(spec, start, micro, stepped, i) for i in (0, 1)}}
