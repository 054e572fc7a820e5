"""Every shipped recipe (bigtrain/recipes/*.yaml) holds up without a GPU or a download: it loads as a run config,
its header names the job, model, hardware, data and time, the DeepSpeed JSON it generates for its hardware passes
the lint, bigtrain's memory estimate of it fits the GPUs it names (the shapes of the Hub models it names ship with
bigtrain), and the Hub model it names is one of those shapes. `bigtrain recipes` lists and copies them; the files
ship in the wheel. That each one trains: tests/dist/test_recipes_train.py."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from launch import BIN, REPO
from messages import naming

from bigtrain.estimate.recommend import fits
from bigtrain.recipes.catalog import HEADER_KEYS, Hardware, recipe, recipes

ALL = recipes()
WANTED = {"gpt2-124m-pretrain", "llama3.1-8b-sft-full", "llama3.1-8b-sft-lora", "qwen3-8b-dpo-lora",
          "llama3.1-8b-reward", "qwen3-30b-a3b-sft-ep", "llama3.1-8b-long-context", "qwen3-8b-grpo-lora"}


def test_the_jobs_people_run_have_a_recipe():
    assert WANTED <= {r.name for r in ALL}


@pytest.mark.parametrize("item", ALL, ids=lambda r: r.name)
def test_a_recipe_loads_lints_and_fits_its_hardware(item):
    from bigtrain.models.hub import SHAPES, is_hub_name
    assert set(item.header) == set(HEADER_KEYS) and all(item.header.values())
    run = item.run_config()
    if run.model.pretrained:  # a Hub model whose shape ships: estimated without a download, and named in the header
        assert is_hub_name(run.model.pretrained) and run.model.pretrained in item.header["model"]
        assert (SHAPES / run.model.pretrained.replace("/", "--") / "config.json").is_file()
    hw = item.hardware
    resolved = item.deepspeed()  # raises LintError (a ValueError) naming every problem
    config = resolved.ds_config
    assert config["train_batch_size"] == run.batch.global_batch
    assert config["zero_optimization"]["stage"] == run.zero.stage
    est = item.memory()
    assert est.setup.world_size == hw.world_size and est.setup.zero_stage == run.zero.stage
    assert est.setup.lora_r == run.lora.r and est.setup.checkpointing == run.activation_checkpointing.enabled
    print(f"{item.name}: {est.device_peak / 2**30:.1f} GiB per GPU ({est.setup.label}) on {hw}")
    assert fits(est, hw.gpu_mem, None, headroom=0.1), f"{item.name}: {est.device_peak / 2**30:.1f} GiB on {hw}"


def test_the_hardware_line_is_read():
    from bigtrain.recipes.catalog import Recipe
    cases = {"8 x 80 GB GPUs (one node)": Hardware(8, 1, 80_000_000_000),
             "2 nodes of 8 x 80 GB GPUs; experts over 8": Hardware(8, 2, 80_000_000_000),
             "1 x 24 GB GPU (an RTX 4090)": Hardware(1, 1, 24_000_000_000)}
    for line, expected in cases.items():
        assert Recipe("x", Path("x"), {"hardware": line}).hardware == expected
    assert str(Hardware(8, 2, 80_000_000_000)) == "2 x 8 x 80 GB"


def bigtrain(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "bigtrain"), *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_recipes_lists_each_with_its_memory_and_copies_one(tmp_path, capsys):
    from bigtrain.cli import main
    assert main(["recipes"]) == 0  # in this process: the estimates made above are reused
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["recipe", "job", "model", "GPUs"] and len(lines) == len(ALL) + 1
    lora = next(line for line in lines if line.startswith("llama3.1-8b-sft-lora "))
    assert naming(lora, "LoRA SFT", "meta-llama/Llama-3.1-8B-Instruct", "1 x 24 GB", "GiB", "zero0+ckpt")
    est = recipe("llama3.1-8b-sft-lora").memory().device_peak / 2**30
    assert f"{est:.1f} GiB" in lora
    copied = bigtrain("recipes", "cp", "llama3.1-8b-sft-lora", str(tmp_path / "my.yaml"))
    assert copied.returncode == 0 and (tmp_path / "my.yaml").read_text() == recipe("llama3.1-8b-sft-lora").path.read_text()
    assert naming(copied.stdout, "bigtrain train --num-gpus 1 --config")
    again = bigtrain("recipes", "cp", "llama3.1-8b-sft-lora", str(tmp_path / "my.yaml"))
    typo = bigtrain("recipes", "cp", "lama-sft-lora", str(tmp_path / "x.yaml"))
    into_dir = bigtrain("recipes", "cp", "qwen3-8b-dpo-lora", str(tmp_path))
    shown = bigtrain("recipes", "show", "gpt2-124m-pretrain")
    assert again.returncode == 2 and naming(again.stderr, "exists", "--force")
    assert typo.returncode == 2 and naming(typo.stderr, "no recipe 'lama-sft-lora'", "llama3.1-8b-sft-lora")
    assert into_dir.returncode == 0 and (tmp_path / "qwen3-8b-dpo-lora.yaml").is_file()
    assert shown.returncode == 0 and shown.stdout == recipe("gpt2-124m-pretrain").path.read_text()
    assert all(p.stderr.count("\n") <= 1 for p in (again, typo))


def test_the_recipes_and_shapes_ship_in_the_wheel(tmp_path):
    """pyproject's package-data: built from a copy of the tree (a build writes build/ beside the sources)."""
    src = tmp_path / "src"
    shutil.copytree(REPO / "bigtrain", src / "bigtrain", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("bigtrain-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    from bigtrain.models.hub import SHAPES
    wanted = {f"bigtrain/recipes/{r.path.name}" for r in ALL}
    wanted |= {f"bigtrain/models/shapes/{p.parent.name}/config.json" for p in SHAPES.glob("*/config.json")}
    assert wanted <= names, sorted(wanted - names)


def test_estimate_takes_a_hub_name_and_reads_only_its_shape(capsys, monkeypatch, tmp_path):
    """A shipped shape needs no download; any other name only its config.json (here: none, offline: one line)."""
    from huggingface_hub import constants

    from bigtrain.cli import main
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    assert main(["estimate", "--model", "hf", "--pretrained", "Qwen/Qwen3-8B", "--num-gpus", "8", "--gpu-mem", "80",
                 "--seq-len", "2048"]) == 0
    out = capsys.readouterr().out
    assert naming(out, "8,190.7M parameters") and naming(out, "bigtrain train", "model.pretrained=Qwen/Qwen3-8B")
    assert main(["estimate", "--model", "hf", "--pretrained", "someone/unknown-model", "--gpu-mem", "80"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and naming(err, "someone/unknown-model", "not in the local Hugging Face cache")
