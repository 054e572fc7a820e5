"""bigtrain's lint gives every public DeepSpeed config the verdict DeepSpeed 0.19.8 itself gives it.

tests/data/public_ds_configs/ holds DeepSpeed JSON files from other people's repositories, copied
verbatim, and manifest.json names each one's source (repository, path, commit) and DeepSpeed's own
verdict, recorded by scripts/judge_ds_configs.py (DeepSpeed's config parser plus
`deepspeed.initialize` on a toy model, HF-style "auto" filled as the HF integration fills it, judged
as a GPU host). That script is slow (one process per file); this test only lints.
"""
import importlib.util
import json
import re
from pathlib import Path

import pytest

from messages import naming

from bigtrain.cli import main
from bigtrain.ds.lint import schema
from bigtrain.ds.lint import DeviceCaps, LintError, errors, lint_problems, read_ds_json
from bigtrain.ds.resolve import triple_world
from bigtrain.config.topology import Topology

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "public_ds_configs"
MANIFEST = json.loads((DATA / "manifest.json").read_text())
GPU_HOST = DeviceCaps("cuda", fp16=True, bf16=True, local=False)  # the judge's `--device cuda`


def bigtrain_verdict(name: str) -> tuple[str, list[str]]:
    """accept/reject and the lines `bigtrain lint` prints for the file (no world size: as written)."""
    notes: list[str] = []
    try:
        config = read_ds_json(DATA / name, notes)
    except LintError as err:
        return "reject", err.problems
    problems = lint_problems(config, GPU_HOST)
    return ("reject" if errors(problems) else "accept"), notes + [str(p) for p in problems]


def test_every_public_config_gets_deepspeeds_verdict():
    files = MANIFEST["files"]
    mismatches = []
    for entry in files:
        verdict, lines = bigtrain_verdict(entry["file"])
        if verdict != entry["verdict"]:
            mismatches.append(f"{entry['file']}: DeepSpeed {entry['verdict']} "
                              f"({entry['judged'].get('reason')}), bigtrain {verdict}: {lines}")
    agree = len(files) - len(mismatches)
    accepted = sum(e["verdict"] == "accept" for e in files)
    print(f"\npublic DeepSpeed configs: {len(files)} ({accepted} accepted, {len(files) - accepted} rejected by "
          f"DeepSpeed {MANIFEST['judged_with']['deepspeed']}); bigtrain's lint agrees on {agree} "
          f"= {agree / len(files):.1%}")
    assert len(files) >= 40
    assert not mismatches, "\n".join(mismatches)


# DeepSpeed accepts these alone, and `bigtrain lint` refuses them for a reason of bigtrain's own that its line
# names: a section the JSON leaves out comes from the run config (README, "Precedence"), here ZeRO-1, and DeepSpeed
# refuses Lamb under ZeRO unless zero_allow_untested_optimizer is set.
BIGTRAIN_FILLS = {"dsexamples__cifar__ds_config_lamb.json": "zero_optimization is not in the JSON: bigtrain filled it "
                                                             "from the run config"}


def test_every_config_deepspeed_accepts_passes_the_whole_lint_command(capsys):
    """`bigtrain lint` as users run it: the run config, "auto" resolution and batch fitting included, at the
    data-parallel size each file's triple was written for. The lint checks alone (above) are not enough: the
    run config's own rules once refused what DeepSpeed takes (axolotl's sub_group_size 0, bfloat16 "auto")."""
    mismatches = []
    for entry in MANIFEST["files"]:
        if entry["verdict"] != "accept":
            continue
        config = read_ds_json(DATA / entry["file"])
        world = triple_world(config) * Topology.of(config, 1).model_split  # the ranks it is written for
        code = main(["lint", str(DATA / entry["file"]), "--world-size", str(world), "--device", "cuda"])
        out, err = capsys.readouterr()
        assert "Traceback" not in err
        said = [line for line in err.splitlines() if line.startswith("bigtrain lint: ")]
        if entry["file"] in BIGTRAIN_FILLS:
            assert code == 2 and len(said) == 1 and BIGTRAIN_FILLS[entry["file"]] in said[0], err
        elif code != 0:
            mismatches.append(f"{entry['file']}: DeepSpeed accepts it, `bigtrain lint` says {said}")
    assert not mismatches, "\n".join(mismatches)


def test_the_lint_command_warns_where_deepspeed_ignores_a_section():
    """zero_optimization.offload_param at stage 2: DeepSpeed runs it without the offload; lint says so, naming the
    JSON's key (not the run config's offload.param)."""
    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["lint", str(DATA / "efficientdl__deepspeed__zero2-offload-model.json"), "--world-size", "1",
                     "--device", "cuda"])
    assert code == 0, err.getvalue()
    assert naming(err.getvalue(), "warning: zero_optimization.offload_param", "stage 3", "stage 2"), err.getvalue()
    assert "offload.param=" not in err.getvalue()


@pytest.mark.parametrize("name, key", [
    ("transformers__tests__deepspeed__ds_config_zero3.json", "zero_optimization.reduce_bucket_size=0"),
    ("dsexamples__training__cifar__ds_config.json", "unknown key 'bf16.loss_scale'"),
    ("dsexamples__bing_bert__deepspeed_bsz4k_onebit_config_seq128.json", "1-bit optimizers"),
    ("deepspeed__tests__unit__ds_batch_config.json", "optimizer.params.max_grad_norm"),
    ("dsexamples__Megatron-LM-v1.1.5-ZeRO3__examples__ds_zero_stage_3_config.json",
     "did you mean 'stage3_param_persistence_threshold'?"),
    ("dsexamples__compression__gpt2__config__ds_config_W8A8_Qgroup64_fp16.json", "compression library has been removed"),
    ("axolotl__deepspeed_configs__zero1_torch_compile.json", "unknown key 'compile.disable'"),
])
def test_rejections_name_the_key_deepspeed_refused(name, key):
    entry = next(e for e in MANIFEST["files"] if e["file"] == name)
    verdict, lines = bigtrain_verdict(name)
    assert entry["verdict"] == verdict == "reject"
    assert any(key in line for line in lines), lines
    assert not any("validation error for" in line for line in lines)  # never a bare pydantic header


def test_accepted_files_warn_about_keys_deepspeed_ignores():
    verdict, lines = bigtrain_verdict("llamafactory__examples__deepspeed__ds_z2_autotp_config.json")
    assert naming(lines, "warning: key '_comment'", "not read"), lines
    verdict, lines = bigtrain_verdict("dsexamples__training__imagenet__config__ds_config.json")
    assert verdict == "accept" and any("not strict JSON" in line and "hjson" in line for line in lines)


def test_manifest_names_source_and_verdict_of_every_file():
    names = {e["file"] for e in MANIFEST["files"]}
    assert names == {p.name for p in DATA.glob("*.json")} - {"manifest.json"}
    for entry in MANIFEST["files"]:
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", entry["repo"]) and entry["path"].endswith(".json")
        assert re.fullmatch(r"[0-9a-f]{40}", entry["commit"])
        assert entry["verdict"] in ("accept", "reject")
        assert entry["verdict"] == "accept" or entry["judged"]["reason"]
    assert len({e["repo"] for e in MANIFEST["files"]}) >= 5


def test_judge_fills_auto_only_where_the_hf_integration_does():
    spec = importlib.util.spec_from_file_location("judge", REPO / "scripts" / "judge_ds_configs.py")
    judge = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(judge)
    assert set(judge.HF_FILLS) <= schema.hf_auto_keys()
    assert {"train_batch_size", "gradient_clipping", "optimizer.params.lr", "scheduler.params.total_num_steps",
            "zero_optimization.stage3_gather_16bit_weights_on_model_save"} <= schema.hf_auto_keys()


def test_keys_read_outside_the_parser_are_still_in_deepspeed():
    """OUTSIDE_PARSER is the one hand-kept list: each key must still occur in the DeepSpeed source."""
    import deepspeed
    root = Path(deepspeed.__file__).parent
    source = (root / "__init__.py").read_text() + (root / "runtime" / "pipe" / "engine.py").read_text()
    for key in schema.OUTSIDE_PARSER:
        assert f"'{key[-1]}'" in source or f'"{key[-1]}"' in source, key


AUTOTP = str(DATA / "llamafactory__examples__deepspeed__ds_z2_autotp_config.json")


@pytest.mark.parametrize("named, code, said", [
    ([], 0, "note: no model named: the split (tensor=2) is judged as DeepSpeed judges the JSON; --model FAMILY"),
    (["--model", "gpt2"], 2, "bigtrain lint: parallel.tensor=2: the gpt2 family does not support tensor parallelism"),
    (["--set", "model.family=gpt2"], 2, "the gpt2 family does not support tensor parallelism"),
    (["--model", "llama"], 0, None),
])
def test_lint_holds_a_split_to_the_family_it_is_told_about(capsys, named, code, said):
    """LLaMA-Factory's AutoTP config, which DeepSpeed accepts at 2 ranks: the run config's default family (GPT-2)
    is nobody's choice, so only a family named on the command line (or in --config) refuses it."""
    assert main(["lint", AUTOTP, "--world-size", "2", "--device", "cuda", *named]) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if said:
        assert said in err, err
    assert ("no model named" in err) == (not named), err


def test_a_run_config_that_names_a_family_applies_its_rules(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  family: gpt2\n")
    assert main(["lint", AUTOTP, "--world-size", "2", "--device", "cuda", "--config", str(config)]) == 2
    assert "the gpt2 family does not support tensor parallelism" in capsys.readouterr().err
    config.write_text("zero:\n  stage: 2\n")  # a run config that names no family: the JSON judged alone
    assert main(["lint", AUTOTP, "--world-size", "2", "--device", "cuda", "--config", str(config)]) == 0
