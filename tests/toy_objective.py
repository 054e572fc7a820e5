"""A test-only objective added the way a new one is (bigtrain/objectives/__init__.py): its own file (this one) and a
line in the table, nothing else. `python tests/toy_objective.py OUT` adds the line before the run config is first
imported (as an edit of the table would), then runs it through the real config rules, `bigtrain estimate`'s
counting and the stepper on one rank, and prints what it saw as JSON (tests/unit/test_objective_seam.py asserts).

The toy: scale x the answer tokens' mean negative log-likelihood + beta x the mean gap of each row's answer
log-probability to a frozen copy (0 at the first step, where the policy is the copy); a frozen teacher directory
held beside the policy, whose logits it reports (`toy/teacher_logits`).
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bigtrain.fields import doc
from bigtrain.objectives.base import FineTuning, FrozenModel, Needs, Objective, Policy, check_positive

SEQ, VOCAB = 32, 256


@dataclass(kw_only=True)
class ToySettings:
    scale: float = doc(2.0, "toy: the factor on the answer tokens' mean negative log-likelihood.")
    beta: float = doc(0.5, "toy: the weight of the gap to the reference.")  # dpo's, kto's default is 0.1
    teacher: str | None = doc(None, "toy: a Hugging Face directory held frozen beside the policy.")

    def __post_init__(self) -> None:
        check_positive(self, "scale")


class ToyLoss(Objective):
    needs = Needs(layout="rows", references=("copy",), frozen_models=(FrozenModel("teacher"),), dropout=False,
                  refuses={"packing": "the toy reads whole rows", "pipeline": "not supported",
                           "tensor": "not supported", "compile": "not supported",
                           "chunked_loss": "not supported"})
    Settings = ToySettings
    fine_tuning = FineTuning(lr=3e-5)  # what it trains a pretrained model at when the run sets none
    summary = "a test-only objective"

    def micro_loss(self, policy: Policy, item: Any, step: Any) -> tuple[Any, dict]:
        import torch
        inputs, labels = item
        ref = policy.reference_logps(inputs, labels)
        teacher = policy.frozen("teacher").logits(inputs)
        logps, counts = policy.answer_logps(inputs, labels)
        gap = (logps - ref).mean()
        loss = self.settings.scale * -(logps.sum() / counts.sum()) + self.settings.beta * gap
        return loss, {"toy/gap": gap.detach().to(torch.float64),
                      "toy/teacher_logits": teacher.float().mean().to(torch.float64)}


def rows() -> dict:
    import torch
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    labels = torch.full_like(ids, -100)
    labels[:, 10:20] = ids[:, 10:20]
    return {"input_ids": ids, "labels": labels}


def refusals(load: Any, base: list[str]) -> dict[str, str]:
    said = {}
    for name, sets in {"packing": ["data.packing=true"], "adapters_off": ["objective.reference=adapters_off"],
                       "none": ["objective.reference=none"], "scale": ["objective.scale=0"],
                       "sequence": ["parallel.sequence=2", "objective.teacher=somewhere"]}.items():
        try:
            load(None, base + sets)
        except ValueError as err:
            said[name] = str(err)
    return said


def main(out: Path) -> dict:
    import bigtrain.objectives as objectives
    objectives.OBJECTIVES["toy"] = ToyLoss  # the table's new line, before anything reads it

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from bigtrain.config.load import load_run_config
    from bigtrain.config.objective import ObjectiveConfig
    from bigtrain.ds.resolve import resolve
    from bigtrain.estimate.memory_model import estimate, setup_from_run
    from bigtrain.estimate.shape import frozen_params, shape_from_spec
    from bigtrain.fields import field_doc
    from bigtrain.models import build
    from bigtrain.models.losses import answer_logps
    from bigtrain.train.engine import Engine, EngineOptions

    torch.manual_seed(7)
    teacher_dir = out / "teacher"
    AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                                 max_position_embeddings=64)).save_pretrained(teacher_dir)
    base = ["model.family=llama", "model.size=tiny", "precision=fp32", "zero.stage=1", "batch.micro_batch=2",
            "batch.global_batch=2", "optimizer.lr=0.01", "schedule.kind=constant", "optimizer.torch_adam=true",
            "objective.kind=toy"]
    run = load_run_config(None, base + ["objective.scale=3", f"objective.teacher={teacher_dir}"])
    beta = {f.name: f for f in ObjectiveConfig.__dataclass_fields__.values()}["beta"]
    seen = {"settings": repr(run.objective.settings), "beta_default": beta.default, "beta_doc": field_doc(beta),
            "dpo_beta": load_run_config(None, ["objective.kind=dpo"]).objective.settings.beta,
            "refusals": refusals(load_run_config, base),
            "wrong_data": objectives.data_problem("toy", ToyLoss.needs, "pairs", False),
            "data_for_it": objectives.data_problem("dpo", objectives.OBJECTIVES["dpo"].needs, "rows", False)}

    spec = build("llama", "tiny", vocab_size=VOCAB, seq_len=SEQ)
    setup = setup_from_run(run, 1, 1, frozen_params=frozen_params(run.objective, SEQ))
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir)
    seen["frozen_params"], seen["teacher_params"] = setup.frozen_params, sum(p.numel() for p in teacher.parameters())
    seen["policy_params"] = spec.num_params
    held = estimate(shape_from_spec(spec, "fp32"), setup)
    seen["estimated_frozen_bytes"] = held.reference + held.frozen  # the reference copy and the teacher

    objective = objectives.build_objective(run.objective)
    seen["reference"], seen["flops_factor"] = objective.reference, objective.flops_factor()
    engine = Engine(spec, resolve(run, None, 1).ds_config, EngineOptions(seed=1), objective)
    batches = iter([rows()] * 2)
    seen["losses"] = [float(engine.train_step(batches))]
    seen["metrics"] = {k: float(v) for k, v in engine.step_metrics.items()}
    seen["losses"].append(float(engine.train_step(batches)))
    with torch.no_grad():  # by hand, from the initial weights: the gap is 0 (the policy is the reference)
        batch = rows()
        logps, counts = answer_logps(spec.build(seed=1)(input_ids=batch["input_ids"]).logits, batch["labels"])
        seen["by_hand"] = float(3 * -(logps.sum() / counts.sum()))
        seen["teacher_logits"] = float(teacher(input_ids=batch["input_ids"]).logits.mean())
    return seen


if __name__ == "__main__":
    import deepspeed
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": sys.argv[2]})
    deepspeed.init_distributed(dist_backend="gloo")
    print("SEEN " + json.dumps(main(Path(sys.argv[1]))))
    deepspeed.comm.destroy_process_group()
