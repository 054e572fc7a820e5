"""A real run, moved: one tiny GPT-2 run (1 rank, plain python, ZeRO-2, 2 steps) trained in one folder and
moved to another, then exported, and copies holding a malicious pickle fed to export and to --resume (the
checkpoint's state and safe loading without training: tests/unit/test_checkpoint_state.py)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch import REPO, TINY, rank_env
from messages import error_lines, naming

from bigtrain.checkpoint import store
from bigtrain.checkpoint.safe_load import load_torch_file
from bigtrain.checkpoint.state import VERSION, read_state

TAG = "step_000002"


class Exploit:
    """A pickle that writes `marker` when unpickled: what a hostile checkpoint could do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


@pytest.fixture(scope="module")
def moved_run(tmp_path_factory) -> Path:
    """A tiny GPT-2 run (1 rank, ZeRO-2, 2 steps) trained in one folder and moved to another."""
    root = tmp_path_factory.mktemp("trained")
    proc = subprocess.run([sys.executable, "bigtrain/run.py", "--out", str(root / "run"), *TINY, "--steps", "2",
                           "--set", "zero.stage=2"], cwd=REPO, env=rank_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    shutil.move(root / "run", root / "moved")
    return root / "moved"


def test_a_moved_run_exports_and_reloads(moved_run, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bigtrain.export import export_checkpoint

    marker = json.loads((moved_run / "checkpoints" / TAG / store.MARKER).read_text())
    assert (marker["version"], marker["run_dir"], marker["tokenizer_dir"]) == (VERSION, "../..", "tokenizer")
    result = export_checkpoint(moved_run, tmp_path / "hf")
    assert (result.layout, result.tokenizer) == ("zero", str(moved_run / "tokenizer"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    masters = get_fp32_state_dict_from_zero_checkpoint(str(moved_run / "checkpoints"), TAG)
    assert torch.equal(model.state_dict()["transformer.h.1.mlp.c_fc.weight"],
                       masters["transformer.h.1.mlp.c_fc.weight"])
    text = "The quick brown fox jumps over the lazy dog."
    assert AutoTokenizer.from_pretrained(str(tmp_path / "hf"))(text)["input_ids"] == \
        AutoTokenizer.from_pretrained(str(moved_run / "tokenizer"))(text)["input_ids"]


def poisoned_copy(run: Path, where: Path, file: str) -> tuple[Path, Path]:
    """A copy of `run` whose `file` in the newest checkpoint also holds an exploit; the marker is
    rewritten, so the checkpoint looks complete. Returns (copy, the exploit's marker file)."""
    shutil.copytree(run, where)
    tag = where / "checkpoints" / TAG
    exploit_marker = where.parent / f"{where.name}_exploit_ran"
    content = load_torch_file(tag / file)
    content["extra"] = Exploit(exploit_marker)
    torch.save(content, tag / file)
    store.write_marker(tag, read_state(tag))
    assert store.check_complete(tag) is None
    return where, exploit_marker


def test_export_refuses_a_malicious_pickle(moved_run, tmp_path, capsys):
    from bigtrain.export.__main__ import main as export_main

    run, exploit_ran = poisoned_copy(moved_run, tmp_path / "run", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert export_main([str(run), "--out", str(tmp_path / "hf")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    poisoned = run / "checkpoints" / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert line.startswith("bigtrain export: ") and naming(line, str(poisoned), "builtins.exec"), line  # file, global
    assert "--trust-checkpoint" in line and not exploit_ran.exists() and not (tmp_path / "hf").exists()


def test_resume_refuses_a_malicious_pickle(moved_run, tmp_path):
    run, exploit_ran = poisoned_copy(moved_run, tmp_path / "run", "rng_rank0.pt")
    proc = subprocess.run([sys.executable, "bigtrain/run.py", "--out", str(run), *TINY, "--steps", "3",
                           "--set", "zero.stage=2", "--resume"], cwd=REPO, env=rank_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = error_lines(proc.stderr)
    poisoned = run / "checkpoints" / TAG / "rng_rank0.pt"
    assert len(lines) == 1 and naming(lines, str(poisoned), "builtins.exec"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not exploit_ran.exists()
    assert not (run / "checkpoints" / "step_000003").exists()
