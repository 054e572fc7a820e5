"""DeepSpeed's ops are built once per environment (bigtrain/distributed/op_builds.py): two environments on one machine
shared ~/.cache/torch_extensions, and each rebuilt the shared-memory all-reduce whenever the other had built it last.
Every place that builds ops resolves one folder per environment (unless the user set TORCH_EXTENSIONS_DIR), and the
start says when a build is about to happen and why."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bigtrain.distributed.op_builds import (VAR, build_note, environment_key, environment_ops_dir, optimizer_op,
                                            use_environment_ops_dir)

REPO = Path(__file__).resolve().parents[2]
OTHER = "/elsewhere/venv/lib/python3.11/site-packages"  # another environment's site-packages


def ninja_file(sources: str) -> str:
    """What torch's cpp_extension writes for DeepSpeed's shared-memory op (its words that matter here)."""
    return (f"cflags = -DTORCH_EXTENSION_NAME=deepspeed_shm_comm -I{sources}/deepspeed/ops/csrc/cpu/includes "
            f"-isystem {sources}/torch/include -fPIC\n"
            f"build shm.o: compile {sources}/deepspeed/ops/csrc/cpu/comm/shm.cpp\n")


def built(root: Path, sources: str, op: str = "deepspeed_shm_comm") -> Path:
    folder = root / op
    folder.mkdir(parents=True)
    (folder / f"{op}.so").write_bytes(b"\x7fELF")
    (folder / "build.ninja").write_text(ninja_file(sources))
    return folder


def our_site_packages() -> str:
    import deepspeed
    return str(Path(os.path.abspath(deepspeed.__file__)).parents[1])  # as the interpreter reached it


def test_two_environments_build_in_two_folders_and_one_in_one():
    a, b = environment_ops_dir("/clones/a/.venv"), environment_ops_dir("/clones/b/.venv")
    assert a != b and a.parent == b.parent  # side by side under torch's per-user root
    from torch.utils.cpp_extension import get_default_build_root
    assert a.parent == Path(get_default_build_root())
    assert environment_ops_dir("/clones/a/.venv") == a
    # the versions it was built for are in the name (an upgrade in place builds afresh, the old folder stays)
    from importlib.metadata import version
    assert f"torch{version('torch')}" in a.name and f"deepspeed{version('deepspeed')}" in a.name
    assert environment_key() == environment_ops_dir().name


def test_bigtrain_train_gives_the_ranks_torchs_folder_without_importing_torch(monkeypatch, tmp_path):
    """The launching process works out torch's per-user root as torch does, without the import (about 2.5 CPU
    seconds before a one-rank job's rank could start)."""
    monkeypatch.delenv(VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    script = ("import sys; from bigtrain.launch.train import thread_env; "
              "print(thread_env(1)['TORCH_EXTENSIONS_DIR']); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    from torch.utils.cpp_extension import get_default_build_root
    assert out == [str(Path(get_default_build_root()) / environment_key()), "False"]
    assert get_default_build_root() == str((tmp_path / "cache").resolve() / "torch_extensions")


def test_one_environment_reached_through_a_link_builds_apart(tmp_path):
    """A clone whose .venv links to another's: ninja compares the sources' paths as written, so the link's builds
    and the target's must not share a folder (they rebuilt each other's ops at every alternation)."""
    target = tmp_path / "main" / ".venv"
    target.mkdir(parents=True)
    link = tmp_path / "clone" / ".venv"
    link.parent.mkdir()
    link.symlink_to(target)
    assert environment_key(str(link)) != environment_key(str(target))
    assert environment_key(str(tmp_path / "main" / "x" / ".." / ".venv")) == environment_key(str(target))


def test_a_users_folder_is_kept_and_otherwise_the_environments_is_set():
    env = {VAR: "/scratch/my-ops"}
    assert use_environment_ops_dir(env) == Path("/scratch/my-ops") and env == {VAR: "/scratch/my-ops"}
    env = {}
    assert use_environment_ops_dir(env) == environment_ops_dir() and env[VAR] == str(environment_ops_dir())
    env = {VAR: ""}  # set but empty: torch would ignore it too
    assert use_environment_ops_dir(env) == environment_ops_dir()


def test_every_launch_of_ranks_builds_in_the_same_folder(monkeypatch, tmp_path):
    """`bigtrain train` / `bigtrain eval` (launch_env) and the test harness (rank_env) give their ranks this
    environment's folder, or the user's."""
    from launch import rank_env

    from bigtrain.launch.train import thread_env
    monkeypatch.delenv(VAR, raising=False)
    assert thread_env(2)[VAR] == rank_env()[VAR] == str(environment_ops_dir())
    monkeypatch.setenv(VAR, str(tmp_path))
    assert thread_env(2)[VAR] == rank_env()[VAR] == str(tmp_path)


def test_the_note_says_when_and_why_an_op_is_built(tmp_path):
    note = build_note("deepspeed_shm_comm", tmp_path)
    assert note is not None and "deepspeed_shm_comm" in note and f"none in {tmp_path}" in note
    built(tmp_path / "ours", our_site_packages())
    assert build_note("deepspeed_shm_comm", tmp_path / "ours") is None  # loaded as it is: nothing to say
    built(tmp_path / "shared", OTHER)
    note = build_note("deepspeed_shm_comm", tmp_path / "shared")
    assert note is not None and f"{OTHER}/deepspeed" in note and "another environment" in note and VAR in note
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "cpu_adam").mkdir()  # a build that was killed: no library
    assert "none in" in build_note("cpu_adam", tmp_path / "half")


@pytest.mark.parametrize("ds_config, op", [
    ({"optimizer": {"type": "AdamW"}, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, "cpu_adam"),
    ({"optimizer": {"type": "Adagrad"}, "zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
     "cpu_adagrad"),
    ({"optimizer": {"type": "Adam", "params": {"torch_adam": True}}}, None),  # torch's Adam: nothing to build
    ({"optimizer": {"type": "AdamW", "params": {}}}, "fused_adam"),
    ({"optimizer": {"type": "Muon"}}, None),
])
def test_the_optimizers_op_is_the_one_deepspeeds_engine_builds(ds_config, op):
    assert optimizer_op(ds_config) == op


def start(tmp_path: Path, ext: Path) -> subprocess.CompletedProcess:
    """run.py as a launcher starts it, with a compiler that fails at once: the start up to the op's build."""
    env = {**os.environ, VAR: str(ext), "PYTHONPATH": str(REPO), "CXX": "false", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(REPO / "bigtrain" / "run.py"), "--model", "gpt2", "--size", "tiny",
                           "--data", "synthetic", "--steps", "1", "--out", str(tmp_path / "run")],
                          env=env, capture_output=True, text=True, timeout=300)


def test_the_start_says_an_op_is_built_over_another_environments_build(tmp_path):
    """The issue's case: the folder holds the other environment's build. The line comes before the build starts
    (the build itself fails here at once: the compiler is `false`)."""
    shared = tmp_path / "torch_extensions"
    built(shared, OTHER)
    proc = start(tmp_path, shared)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("bigtrain: building DeepSpeed's")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "deepspeed_shm_comm" in lines[0] and f"{OTHER}/deepspeed" in lines[0]
    assert proc.returncode != 0 and proc.stderr.index(lines[0]) < proc.stderr.index("cpp_extension")


def prebuild_script() -> str:
    """scripts/setup.sh's prebuild, as CI runs it after installing (`BIGTRAIN_PREBUILD_CPU_ADAM=1 bash setup.sh`)."""
    text = (REPO / "scripts" / "setup.sh").read_text()
    return text.split("<<'PY'\n", 1)[1].split("\nPY\n", 1)[0]


def test_setup_prebuilds_where_the_ranks_load_from(monkeypatch, tmp_path):
    """A fresh clone: no TORCH_EXTENSIONS_DIR. The prebuild's folder is the one `bigtrain train`'s ranks and the test
    harness's get (its build fails at once here: the compiler is `false`; it has begun in that folder)."""
    env = {k: v for k, v in os.environ.items() if k != VAR}
    env.update(XDG_CACHE_HOME=str(tmp_path), CXX="false", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", prebuild_script()], env=env, capture_output=True, text=True,
                          timeout=300)
    folder = Path(proc.stdout.split("ops folder: ", 1)[1].split("\n", 1)[0])
    assert folder.parent == tmp_path / "torch_extensions" and (folder / "deepspeed_shm_comm").is_dir()
    from launch import rank_env

    from bigtrain.launch.train import thread_env
    monkeypatch.delenv(VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert thread_env(2)[VAR] == rank_env()[VAR] == str(folder)
