"""A killed build of a DeepSpeed op leaves torch's lock file, and every later build waits on it forever (an H200
job hung 330 s this way): named before the process group starts (bigtrain/distributed/op_locks.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bigtrain.distributed.op_locks import STALE_AFTER_S, build_locks, check_build_locks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def lock(root, *parts, age_s=0.0):
    path = root.joinpath(*parts, "lock")
    path.parent.mkdir(parents=True)
    path.touch()
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_locks_in_both_layouts_are_found_with_their_age(tmp_path):
    default = lock(tmp_path, "py312_cu130", "fused_adam", age_s=120)  # torch's default root
    flat = lock(tmp_path, "cpu_adam", age_s=5)  # TORCH_EXTENSIONS_DIR
    (tmp_path / "py312_cu130" / "shm_comm").mkdir()  # a finished build: no lock
    found = dict(build_locks(tmp_path))
    assert set(found) == {default, flat}
    assert 119 < found[default] < 130 and found[flat] < 15


def test_a_young_lock_is_a_warning_and_an_old_one_an_error_naming_the_file(tmp_path):
    young = lock(tmp_path, "fused_adam", age_s=60)
    (line,) = check_build_locks(tmp_path)
    assert "fused_adam" in line and f"rm {young}" in line and "waits" in line
    old = lock(tmp_path, "cpu_adam", age_s=STALE_AFTER_S + 60)
    with pytest.raises(ValueError, match=rf"cpu_adam op left its lock {old} 31 min ago.*rm {old}"):
        check_build_locks(tmp_path)
    assert check_build_locks(tmp_path / "nothing-built-yet") == []


def test_a_run_with_a_stale_lock_is_one_line_before_any_rank_waits(tmp_path):
    """Through run.py as the launcher starts it: exit 2 and one line, no traceback, no hang."""
    stale = lock(tmp_path / "ext", "fused_adam", age_s=2 * 3600)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bigtrain", "run.py"), "--model", "gpt2", "--size", "tiny",
                           "--data", "synthetic", "--steps", "1", "--out", str(tmp_path / "run")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and f"rm {stale}" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()
