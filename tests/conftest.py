"""Test tiers by folder: tests/unit/ starts no launcher (under 2 minutes on 2 cores); tests/dist/ starts real
ranks (the deepspeed launcher, torchrun, `bigtrain train`, Ray, spawned gloo ranks). Every test under tests/dist/
is marked `dist` here, so `pytest tests/unit` and `pytest -m "not dist"` select the same tests.

Helpers both tiers import live beside this file (on sys.path from here): launch.py (start ranks and read back
what they wrote), local_hf.py (local Hugging Face directories), messages.py (assert what a message names, not
its wording); dist_scripts/ holds what launched ranks run and data/ other people's DeepSpeed configs and the
CLI surface.

The folder is kept honest: a test under tests/unit/ (or a fixture it uses) that starts a launcher fails with a
line saying so, so the unit tier never grows a launcher run; a test module outside both folders fails too. Each
test file's cost is held to its budget (tests/budget.py, the budgets in tests/budgets.py).

Before its first dist test, each test process loads (building where none is built yet) the DeepSpeed ops that
launched ranks build on first use: the shared-memory all-reduce every CPU rank joins its process group with, and CPU
Adam for optimizer offload. A build takes 1-3 minutes of a fresh machine; done inside a test, its lock made every
run started meanwhile print a warning line and wait (the lines a test counts then counted one too many). Done here,
no launched rank builds an op.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

# torch.compile off for the suite and every process it starts, except where compiling is the subject
# (tests/dist/test_compile_training.py sets it to 0): DeepSpeed's Muon decorates its Newton-Schulz with
# torch.compile, so each rank that builds a ZeRO engine imported inductor (~1.4 CPU s) and each Muon job compiled
# C++ kernels for the CPU (31.6 CPU s in a process with an empty inductor cache, as CI's is) for the same losses to
# the bit; test_levers.py fell from 118 to 72 CPU s. bigtrain's own `train.compile` never compiles on a CPU unless asked.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

TESTS = Path(__file__).resolve().parent
UNIT, DIST = TESTS / "unit", TESTS / "dist"
sys.path.insert(0, str(TESTS))  # launch.py, local_hf.py, messages.py

_current: list = [None]  # the test being set up, run or torn down


def tier(item) -> str | None:
    """"unit" or "dist" from the test's folder; None for a test outside both."""
    path = Path(item.path).resolve()
    return next((name for name, folder in (("unit", UNIT), ("dist", DIST)) if path.is_relative_to(folder)), None)


def starts_a_launcher(args) -> bool:
    """A command that starts ranks: the deepspeed launcher, torchrun, `bigtrain train`, or a Ray cluster."""
    argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
    if "--help" in argv or "-h" in argv:
        return False
    names = [Path(a).name for a in argv]
    if any(n in ("deepspeed", "torchrun", "gcs_server", "raylet") for n in names[:1]) \
            or "deepspeed.launcher.launch" in argv:
        return True
    cli = [i for i, n in enumerate(names) if n in ("bigtrain", "bigtrain.cli")]
    return bool(cli) and names[cli[0] + 1:cli[0] + 2] in (["train"], ["ray-train"], ["tune"])


_popen_init = subprocess.Popen.__init__


def _guarded_popen_init(self, args, *rest, **kwargs):
    item = _current[0]
    if item is not None and tier(item) != "dist" and starts_a_launcher(args):
        raise AssertionError(f"{item.nodeid} starts a launcher ({' '.join(map(str, args))[:120]}) but is not under "
                             "tests/dist/; move it there so that tests/unit/ stays the tier without launchers")
    _popen_init(self, args, *rest, **kwargs)


def share_the_cores(config) -> None:
    """Each test process its share of the cores, as `bigtrain train` gives its ranks (OMP_NUM_THREADS unless set):
    under `-n 2` on 2 cores one thread each, not torch's default of one per core, which put 4 threads on 2 cores and
    had OpenMP's threads spin waiting for each other. Measured one file at a time on a loaded 2-core VM, default
    against 1 thread, A B A B: test_token_profile.py 36.6 / 20.3 and 40.7 / 16.9 CPU s, test_objectives.py 18.7 / 7.0
    and 76.6 / 4.9. The processes a test starts inherit it; launched ranks get theirs from launch.rank_env."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return  # xdist's controller runs no test: each worker takes its own share
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    import torch
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_configure(config):
    share_the_cores(config)
    # xdist's loadfile otherwise reorders files by their number of tests, which put the two-test, four-minute
    # test_bench_runs last in every run, alone on one worker; keep the order pytest_collection_modifyitems gives
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    subprocess.Popen.__init__ = _guarded_popen_init
    from bigtrain.distributed.op_builds import use_environment_ops_dir
    use_environment_ops_dir()  # DeepSpeed's ops built in this process (one_rank_group) go where the ranks' go
    config.pluginmanager.import_plugin("budget")  # each test file's cost against tests/budgets.py


def pytest_itemcollected(item):
    if tier(item) == "dist":
        item.add_marker(pytest.mark.dist)


def pytest_collection_modifyitems(session, config, items):
    """Files in the order of their budgets, the largest first (a file's tests keep theirs): xdist's loadfile gives a
    free worker the next file in this order, so the long files start first and the unit tier's many short ones fill
    the end, instead of one long file running alone while the other worker idles."""
    from budgets import budget_of
    items.sort(key=lambda item: -budget_of(item.nodeid.split("::", 1)[0]))


def pytest_runtest_setup(item):
    if tier(item) is None:
        pytest.fail(f"{item.nodeid}: a test module belongs in tests/unit/ (no launcher) or tests/dist/ (real "
                    "launchers)", pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if tier(item) == "dist":
        build_deepspeed_ops()
    _current[0] = item
    yield
    _current[0] = None


_ops_built: list = []


def build_deepspeed_ops() -> None:
    """Load, building where needed, the ops a CPU rank builds on first use (once per test process)."""
    if _ops_built:
        return
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    from bigtrain.distributed.op_locks import clear_stale_build_locks
    clear_stale_build_locks()  # a build killed with the machine waits every later one on its lock, silently
    for name in ("ShareMemCommBuilder", "CPUAdamBuilder"):
        builder = get_accelerator().create_op_builder(name)
        if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME):
            try:
                builder.load(verbose=False)
            except Exception as err:  # noqa: BLE001 -- the ranks then fail on it themselves, in their tests
                print(f"conftest: DeepSpeed's {builder.NAME} op did not build here: {err}", file=sys.stderr)
    _ops_built.append(True)


@pytest.fixture(scope="module")
def one_rank_group():
    """A 1-rank gloo group in this process (DeepSpeed's monitors and engine ask deepspeed.comm for the rank).
    Torn down through deepspeed.comm, so that the next module's group is a fresh one in DeepSpeed's eyes too."""
    import os

    import deepspeed
    from deepspeed import comm as dist

    # port 0: the store of a world of one binds a port the kernel picks and holds (no port picked, then bound later)
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    deepspeed.init_distributed(dist_backend="gloo")
    yield dist
    dist.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
