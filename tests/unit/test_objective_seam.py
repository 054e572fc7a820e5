"""The objective seam: no file outside bigtrain/objectives/ names an objective kind but the one table, and
a new objective is added by its own file and a line in that table: a test-only one (tests/toy_objective.py), with
settings of its own, a reference, a frozen teacher directory and refusals, goes through the real config rules, the
estimate's counting and the stepper on one rank."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bigtrain.objectives import OBJECTIVES
from launch import REPO, free_port

PACKAGE = REPO / "bigtrain"
# Record formats are named for what they hold ("kto" records: prompt, completion, label); the data imports no
# objective, so a name there is a format's, not a kind's decision.
FORMATS = PACKAGE / "data"


def kind_names(tree: ast.AST, kinds: set[str]) -> list[int]:
    """The lines of `tree` holding a string constant that is an objective kind (a comparison `kind != "lm"`, a
    table, a default, a message listing them word for word); a name stored under such a key (`metrics["reward"] =
    ...`, TRL's metric) is a metric's name, not a kind's decision."""
    stored = {id(node.slice) for node in ast.walk(tree) if isinstance(node, ast.Subscript)
              and isinstance(node.ctx, ast.Store)}
    return sorted({node.lineno for node in ast.walk(tree) if isinstance(node, ast.Constant)
                   and isinstance(node.value, str) and node.value in kinds and id(node) not in stored})


# the benchmark's cases are run configs written as a user writes them (`--set objective.kind=grpo`, as recipes' YAML)
BENCH_CASES = PACKAGE / "bench"


def test_no_file_outside_objectives_names_an_objective_kind():
    kinds = set(OBJECTIVES)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if PACKAGE / "objectives" in path.parents or FORMATS in path.parents or path.parent == BENCH_CASES:
            continue
        found += [f"{path.relative_to(REPO)}:{line}" for line in kind_names(ast.parse(path.read_text()), kinds)]
    assert not found, "objective kinds named outside bigtrain/objectives/ (ask the objective's Needs): " + \
        ", ".join(found)


def test_the_scan_finds_a_kind_named_in_code():
    code = ('if objective.kind != "lm":\n    x = 1\nfits = {"pairs": "dpo"}\nsaid = f"objective.kind={kind}"\n'
            'metrics["reward"] = 1.0\nkind: str = "kto"\n')
    assert kind_names(ast.parse(code), set(OBJECTIVES)) == [1, 3, 6]


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("toy")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "toy_objective.py"), str(out), str(free_port())],
                          capture_output=True, text=True, timeout=300, env=env, cwd=out)
    seen = [line for line in proc.stdout.splitlines() if line.startswith("SEEN ")]
    assert proc.returncode == 0 and seen, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(seen[-1].removeprefix("SEEN "))


def test_a_new_objectives_settings_are_in_the_run_config(toy):
    """--set objective.scale / objective.teacher reach its own settings; `beta`, whose default it does not share
    with dpo and kto, is one field whose default leaves each objective its own."""
    assert toy["settings"].startswith("ToySettings(scale=3.0, beta=0.5, teacher=")
    assert toy["beta_default"] is None and toy["dpo_beta"] == 0.1
    assert "toy: the weight of the gap to the reference." in toy["beta_doc"] and "toy 0.5" in toy["beta_doc"]


def test_the_config_rules_read_a_new_objectives_declaration(toy):
    said = toy["refusals"]
    assert said["packing"] == ("objective.kind=toy with data.packing=true: the toy reads whole rows; set "
                               "data.packing=false")
    assert said["adapters_off"].startswith("objective.reference=adapters_off with objective.kind=toy: ")
    assert "use objective.reference=copy (or auto)" in said["adapters_off"]
    assert said["none"] == ("objective.kind=toy compares with a reference model: set objective.reference to auto or "
                            "copy")
    assert said["scale"].startswith("objective.scale=0.0: must be > 0")
    assert said["sequence"].startswith("parallel.sequence=2 with objective.teacher and objective.reference=copy: "
                                       "Ulysses replaces transformers' attention for the whole process")
    assert toy["wrong_data"].startswith("objective.kind=toy trains on text or single examples, and this data is "
                                        "preference pairs")
    assert toy["data_for_it"].endswith("or objective.kind=lm for this data (lm, toy)")


def test_a_new_objective_trains_through_the_stepper_with_its_reference_and_frozen_teacher(toy):
    """Its first loss is its formula on the initial weights (the gap to the frozen copy 0), its teacher's logits
    those of the directory loaded by transformers, and the second step has trained."""
    assert toy["reference"] == "copy" and toy["flops_factor"] == pytest.approx(4 / 3)
    assert toy["losses"][0] == pytest.approx(toy["by_hand"], rel=1e-5)
    assert toy["metrics"]["toy/gap"] == pytest.approx(0.0, abs=1e-6)
    assert toy["metrics"]["toy/teacher_logits"] == pytest.approx(toy["teacher_logits"], rel=1e-5, abs=1e-6)
    assert toy["losses"][1] < toy["losses"][0]


def test_the_estimate_counts_a_new_objectives_frozen_model(toy):
    """Its teacher's parameters, read from the directory's config, and the frozen copy its reference is: both whole
    on the one rank at ZeRO-1, in fp32."""
    assert toy["frozen_params"] == toy["teacher_params"] > 0
    assert toy["estimated_frozen_bytes"] == 4 * (toy["teacher_params"] + toy["policy_params"])


def test_the_policys_generate_is_the_rollouts_on_the_plain_module(one_rank_group):
    """`Policy.generate` (what an online-RL objective samples through): a greedy round of completions of
    left-padded prompts on the training engine is `bigtrain.rollout.generate`'s on the plain module with the same
    weights (tests/unit/test_rollout_generate.py holds that one to transformers); the engine trains again after."""
    from types import SimpleNamespace

    import torch

    from bigtrain.config.load import load_run_config
    from bigtrain.ds.resolve import resolve
    from bigtrain.models import build
    from bigtrain.rollout.generate import SampleRNG, Sampling, generate
    from bigtrain.train.engine import Engine, EngineOptions
    run = load_run_config(None, ["model.family=llama", "model.size=tiny", "precision=fp32", "zero.stage=1",
                                 "batch.micro_batch=2", "batch.global_batch=2"])
    spec = build("llama", "tiny", vocab_size=64, seq_len=32)
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=5)
    engine = Engine(spec, resolve(run, None, 1).ds_config, EngineOptions(seed=1), tokenizer=tokenizer)
    prompts = torch.randint(6, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(prompts)
    prompts[1, :3], mask[1, :3] = 0, 0  # a shorter prompt, left-padded
    greedy = Sampling(max_new_tokens=8, temperature=0.0)
    out = engine.policy.generate(prompts, mask, greedy, SampleRNG(0, 0, "cpu"), logps=True)
    want = generate(spec.build(seed=1), tokenizer, prompts, mask, greedy, SampleRNG(0, 0, "cpu"), logps=True)
    assert torch.equal(out.completion_ids, want.completion_ids) and out.completion_ids.shape == (2, 8)
    assert torch.equal(out.completion_mask, want.completion_mask)
    assert torch.allclose(out.logps, want.logps, atol=1e-5)
    assert engine.ds.module.training
