"""Test tiers: `pytest -m "not dist"` is every test that starts no launcher (the unit tier, minutes);
`-m dist` the tests that start ranks through the deepspeed launcher, torchrun or `bigtrain train`.

The marker is kept honest here: a test (or a fixture it uses) that starts a launcher without
`@pytest.mark.dist` fails with a line saying so, so the unit tier never grows a launcher run.
"""
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/launch.py

_current: list = [None]  # the test being set up, run or torn down


def starts_a_launcher(args) -> bool:
    """A command that starts ranks: the deepspeed launcher, torchrun, or `bigtrain train`."""
    argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
    if "--help" in argv or "-h" in argv:
        return False
    names = [Path(a).name for a in argv]
    if any(n in ("deepspeed", "torchrun") for n in names[:1]) or "deepspeed.launcher.launch" in argv:
        return True
    cli = [i for i, n in enumerate(names) if n in ("bigtrain", "bigtrain.cli")]
    return bool(cli) and names[cli[0] + 1:cli[0] + 2] in (["train"], ["ray-train"], ["tune"])


_popen_init = subprocess.Popen.__init__


def _guarded_popen_init(self, args, *rest, **kwargs):
    item = _current[0]
    if item is not None and item.get_closest_marker("dist") is None and starts_a_launcher(args):
        raise AssertionError(f"{item.nodeid} starts a launcher ({' '.join(map(str, args))[:120]}) but is not "
                             "marked @pytest.mark.dist; mark it so that `pytest -m \"not dist\"` stays the unit tier")
    _popen_init(self, args, *rest, **kwargs)


def pytest_configure(config):
    subprocess.Popen.__init__ = _guarded_popen_init


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[0] = item
    yield
    _current[0] = None


@pytest.fixture(scope="module")
def one_rank_group():
    """A 1-rank gloo group in this process (DeepSpeed's monitors and engine ask deepspeed.comm for the rank).
    Torn down through deepspeed.comm, so that the next module's group is a fresh one in DeepSpeed's eyes too."""
    import os

    import deepspeed
    from deepspeed import comm as dist

    from launch import free_port
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
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
