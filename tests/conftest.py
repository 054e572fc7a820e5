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
