"""`bigtrain export`: ZeRO-3 / ZeRO-2 / pipeline checkpoints of real 2-rank runs -> HF GPT-2 directories.

One tiny training run per layout (module-scoped, the three in one launch); the trained model's own logits come from
tests/dist_scripts/export_reference_logits.py, launched with 2 ranks. Export's pieces without a run:
tests/unit/test_export_write.py.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from launch import REPO, TINY, launch_jobs, launch_ranks, rank_env

from bigtrain.export import export_checkpoint, load_exported
from bigtrain.export.__main__ import main as export_main
from bigtrain.export.masters import pipeline_masters, zero_masters
from bigtrain.export.weights import pipeline_layer_states
from bigtrain.export.write import RECIPE

REFERENCE = REPO / "tests" / "dist_scripts" / "export_reference_logits.py"
STEPS = ["--steps", "3"]
TAG = "step_000003"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """One tiny run per layout, all in one 2-rank launch (the pipeline last: its grid stays in DeepSpeed)."""
    root = tmp_path_factory.mktemp("trained")
    layouts = {"z3": ["--set", "zero.stage=3"], "z2": ["--set", "zero.stage=2", "--set", "precision=bf16"],
               "pp": ["--set", "pipeline.stages=2", "--set", "zero.stage=1"]}
    launch_jobs(root, [{"name": name, "args": [*TINY, *STEPS, *args]} for name, args in layouts.items()])
    return root


@pytest.fixture(scope="module")
def z3_run(trained: Path) -> Path:
    return trained / "z3"


@pytest.fixture(scope="module")
def pp_run(trained: Path) -> Path:
    return trained / "pp"


@pytest.fixture(scope="module")
def z2_run(trained: Path) -> Path:
    return trained / "z2"


@pytest.fixture(scope="module")
def references(z3_run: Path, pp_run: Path, tmp_path_factory) -> dict[Path, dict]:
    """The trained models' logits, both runs in one 2-rank launch: {run dir: saved dict}."""
    out = tmp_path_factory.mktemp("ref")
    runs = {z3_run: out / "z3.pt", pp_run: out / "pp.pt"}
    args = [str(a) for run, pt in runs.items() for a in (run / "checkpoints" / TAG, pt)]
    proc = launch_ranks(REFERENCE, args, 2, env=rank_env(), timeout=240)
    assert proc.returncode == 0, f"reference logits failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
    return {run: torch.load(pt) for run, pt in runs.items()}


def hf_logits(export_dir: Path, input_ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(export_dir), local_files_only=True).eval()
    with torch.no_grad():
        return model(input_ids).logits


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.rglob("*")}


def _check_trained_logits(run: Path, ref: dict, tmp_path: Path, layout: str) -> None:
    tag_dir = run / "checkpoints" / TAG
    before = snapshot(run / "checkpoints")
    result = export_checkpoint(run, tmp_path / "hf")  # the run's out dir: export finds checkpoints/ itself
    assert (result.layout, result.format, result.checkpoint) == (layout, "huggingface", tag_dir)
    assert snapshot(run / "checkpoints") == before  # the checkpoint is only read
    assert ref["logits"].shape == (4, 64, 512)
    assert (ref["logits"] - ref["fresh_logits"]).abs().max() > 1e-3  # the load changed the model
    diff = (hf_logits(tmp_path / "hf", ref["input_ids"]) - ref["logits"]).abs().max().item()
    assert diff <= 1e-5, f"{layout}: exported logits differ from the trained model's by {diff}"
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    run_tok = AutoTokenizer.from_pretrained(str(run / "tokenizer"))
    assert tok("hello world")["input_ids"] == run_tok("hello world")["input_ids"]


def test_zero3_export_gives_the_trained_logits(z3_run: Path, references: dict, tmp_path: Path) -> None:
    _check_trained_logits(z3_run, references[z3_run], tmp_path, "zero3")


def test_pipeline_export_gives_the_trained_logits(pp_run: Path, references: dict, tmp_path: Path) -> None:
    _check_trained_logits(pp_run, references[pp_run], tmp_path, "pipeline")


def test_pipeline_fp32_masters_map_to_layers(pp_run: Path) -> None:
    """The stages' optimizer masters, named back to layers, are the (fp32) layer files' weights."""
    from bigtrain.export.locate import locate_checkpoint
    from bigtrain.models import build
    found = locate_checkpoint(pp_run / "checkpoints" / TAG)
    spec = build("gpt2", "tiny", **found.state.model_build.overrides)
    layers = pipeline_layer_states(found.tag_dir, spec)
    masters = pipeline_masters(found.tag_dir, spec, stages=2)
    assert sorted(masters) == sorted(layers) == [0, 1, 2, 3, 4]
    for idx, local in layers.items():
        assert sorted(masters[idx]) == sorted(local)
        for name, tensor in local.items():
            assert torch.equal(masters[idx][name], tensor), (idx, name)


def resave_marker(tag_dir: Path) -> None:
    from bigtrain.checkpoint.state import read_state
    from bigtrain.checkpoint.store import write_marker
    write_marker(tag_dir, read_state(tag_dir))


def test_pipeline_bf16_layers_use_fp32_masters(pp_run: Path, tmp_path: Path) -> None:
    """As a bf16 pipeline run saves them (layer files = masters rounded to bf16), export takes the
    fp32 masters; a layer that does not match its master makes it fall back to the upcast weights."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(pp_run / "checkpoints" / TAG, ckpt / TAG)
    fp32 = {p.name: torch.load(p) for p in (ckpt / TAG).glob("layer_*-model_states.pt")}
    for name, state in fp32.items():
        torch.save({k: v.bfloat16() for k, v in state.items()}, ckpt / TAG / name)
    resave_marker(ckpt / TAG)  # as a run would have saved it: the marker's digests are of these files
    result = export_checkpoint(ckpt, tmp_path / "a")
    assert any("fp32 master" in n for n in result.notes), result.notes
    exported = load_exported(tmp_path / "a").state_dict()
    assert torch.equal(exported["transformer.h.1.mlp.c_fc.weight"], fp32["layer_03-model_states.pt"]["mlp.c_fc.weight"])
    assert torch.equal(exported["transformer.wte.weight"], fp32["layer_00-model_states.pt"]["weight"])

    bad = {k: v.bfloat16() for k, v in fp32["layer_04-model_states.pt"].items()}
    bad["weight"] = bad["weight"] + 1
    torch.save(bad, ckpt / TAG / "layer_04-model_states.pt")
    resave_marker(ckpt / TAG)
    result = export_checkpoint(ckpt, tmp_path / "b")
    assert any("do not match at layer 4" in n for n in result.notes), result.notes
    exported = load_exported(tmp_path / "b").state_dict()
    assert torch.equal(exported["transformer.ln_f.weight"], bad["weight"].float())


def test_zero2_export_equals_deepspeed_consolidation(z2_run: Path, tmp_path: Path) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    assert export_main([str(z2_run / "checkpoints"), "--out", str(tmp_path / "hf")]) == 0
    ds = get_fp32_state_dict_from_zero_checkpoint(str(z2_run / "checkpoints"), TAG)
    saved = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(saved) == set(ds) - {"lm_head.weight"}  # tied to wte: HF stores it once
    for name, tensor in saved.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, ds[name]), name
    # bf16 training: the export holds the fp32 masters, not bf16-rounded weights
    wte = saved["transformer.wte.weight"]
    assert not torch.equal(wte, wte.bfloat16().float())
    # our own merge of the dp=2 partitions (used for pipeline stages) agrees with DeepSpeed's
    ours = zero_masters(z2_run / "checkpoints" / TAG, mp_rank=0)
    assert all(torch.equal(ours[k], ds[k]) for k in ours) and "transformer.h.1.attn.c_attn.weight" in ours

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    run_tok = AutoTokenizer.from_pretrained(str(z2_run / "tokenizer"))
    text = "The quick brown fox jumps over the lazy dog."
    assert tok(text)["input_ids"] == run_tok(text)["input_ids"] and tok.decode(tok(text)["input_ids"]) == text
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["model_type"], config["architectures"], config["eos_token_id"]) == \
        ("gpt2", ["GPT2LMHeadModel"], run_tok.eos_token_id)
    assert json.loads((tmp_path / "hf" / RECIPE).read_text())["source"]["layout"] == "zero"


def _error(argv: list[str], capsys) -> str:
    assert export_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_bad_inputs_are_clear_errors(z2_run: Path, tmp_path: Path, capsys) -> None:
    ckpts = tmp_path / "ckpts"
    shutil.copytree(z2_run / "checkpoints" / TAG, ckpts / TAG, ignore=shutil.ignore_patterns("bigtrain.json"))
    assert "no complete checkpoint in" in _error([str(ckpts), "--out", str(tmp_path / "o")], capsys)
    assert "not complete: no completion marker" in _error([str(ckpts / TAG), "--out", str(tmp_path / "o")], capsys)
    assert "no checkpoint step_000009" in _error([str(z2_run), "--tag", "9", "--out", str(tmp_path / "o")], capsys)

    out = tmp_path / "full"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert "is not empty" in _error([str(z2_run), "--out", str(out)], capsys)
    assert (out / "keep.txt").is_file()
    assert "overlaps the checkpoint" in _error([str(z2_run), "--out", str(z2_run / "checkpoints"), "--force"], capsys)
    assert export_main([str(z2_run), "--tag", TAG, "--out", str(out), "--force"]) == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".full.*"))  # no temporary directories left behind
