"""Folders a verb cannot write (a file in their place, a read-only mount, no permission) and folders that hold a
model rather than a run: `bigtrain train`, `export` and `prepare` each stop with one line naming --out before any
work; they raised FileExistsError / NotADirectoryError / OSError tracebacks from their first mkdir."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from messages import naming

from bigtrain.checkpoint.claim import run_dir_problem
from bigtrain.data.prepare.cli import main as prepare_main
from bigtrain.writable import unwritable


def _train_line(out: Path) -> str | None:
    return run_dir_problem(out, out / "checkpoints", resume=False, overwrite=False)


def test_a_file_where_the_run_folder_would_be_is_one_line(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    for out in (data, data / "run"):
        assert naming(_train_line(out) or "", "--out", str(data), "is a file", "give --out a folder")
    assert data.read_text() == "{}\n"


def test_a_folder_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    """A read-only mount: access(2) says EROFS for W_OK (as root too, whom a folder's mode does not stop)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == ro else real(p, mode))
    assert naming(_train_line(ro / "run") or "", "--out", str(ro / "run"), "cannot be made", f"{ro} is not writable")
    assert naming(_train_line(ro) or "", "--out", str(ro), "is not writable")
    assert unwritable(tmp_path / "elsewhere" / "run", "--out") is None


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes any folder whatever its mode")
def test_a_folder_without_permission_is_one_line(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        assert naming(_train_line(locked / "run") or "", "--out", "not writable")
    finally:
        locked.chmod(0o700)


def test_a_model_folder_is_no_run_folder(tmp_path):
    """A run written into an export sat beside its weights, and `bigtrain generate OUT` served the old model."""
    model = tmp_path / "exported"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert _train_line(model) is None  # a config alone: no weights to shadow
    (model / "model.safetensors").write_bytes(b"")
    assert naming(_train_line(model) or "", "--out", str(model), "holds a model", "folder of its own")


def test_export_and_prepare_say_the_same_for_their_out(tmp_path, capsys):
    from bigtrain.export.write import check_out_dir
    blocker = tmp_path / "a_file"
    blocker.write_text("keep me")
    with pytest.raises(ValueError) as err:  # what `bigtrain export` asks once it found the run's checkpoint
        check_out_dir(blocker / "exp", False, protected=tmp_path / "run" / "checkpoints" / "step_000001")
    assert naming(str(err.value), "--out", str(blocker / "exp"), "is a file"), err.value
    corpus = tmp_path / "c.txt"
    corpus.write_text("some words\n" * 20)
    assert prepare_main(["--data", str(corpus), "--out", str(blocker / "prep")]) == 2
    line = capsys.readouterr().err.strip()
    assert len(line.splitlines()) == 1 and naming(line, "--out", str(blocker), "is a file"), line
    assert blocker.read_text() == "keep me"
