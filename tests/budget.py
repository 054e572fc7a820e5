"""The suite's time, paid for file by file: a pytest plugin (registered by tests/conftest.py) that adds up what each
test file costs and fails the session when a file passes its budget in tests/budgets.py.

A file's cost is CPU seconds: those of the test process and of every process it started and waited for (the
launchers and their ranks, `bigtrain` commands, lm-eval), over setup, call and teardown of each of its tests. On
the 2-core machines the suite runs on, that is the file's share of the suite's wall time, and it moves far less
than wall time when other jobs load the machine (test_levers.py alone, twice, at loads 7-15: 204 and 300 s of wall
time, 104 and 117 CPU seconds). Time a test spends asleep costs no CPU and is not counted: a fixed sleep is a defect
of its own; so are processes a test leaves to others to reap (Ray's, which its cluster's shutdown ends).

Under pytest-xdist each worker measures its tests and hands the figure to the controller in the report
(`user_properties`), which adds them up. BIGTRAIN_TEST_BUDGET_SCALE multiplies every budget (a slower machine);
BIGTRAIN_TEST_COSTS=FILE writes every file's CPU seconds there as JSON (to set the budgets from a run).
"""
from __future__ import annotations

import json
import os
import resource
from collections import defaultdict
from pathlib import Path

import pytest

from budgets import budget_of, over_budget

MARK = pytest.StashKey[float]()
KEY = "cpu_s"


def cpu_seconds() -> float:
    """CPU time of this process and of its children that have ended (and were waited for)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def scale() -> float:
    return float(os.environ.get("BIGTRAIN_TEST_BUDGET_SCALE", "1"))


def pytest_configure(config):
    config.pluginmanager.register(Budget(), "bigtrain-budget")


class Budget:
    """One session's accounting: an instance per pytest run, so that a run inside a test keeps its own."""

    def __init__(self) -> None:
        self.costs: dict[str, float] = defaultdict(float)  # test file -> CPU seconds, where the session is judged
        self.problems: list[str] = []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item):
        item.stash[MARK] = cpu_seconds()
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        now = cpu_seconds()
        spent = now - item.stash.get(MARK, now)
        item.stash[MARK] = now
        report.user_properties = [*report.user_properties, (KEY, round(spent, 3))]  # its own list: one per phase

    def pytest_runtest_logreport(self, report):
        spent = dict(report.user_properties).get(KEY)
        if spent is not None:
            self.costs[report.nodeid.split("::", 1)[0]] += spent

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session):
        if hasattr(session.config, "workerinput"):  # an xdist worker: the controller adds up and judges
            return
        self.problems = over_budget(self.costs, scale())
        if os.environ.get("BIGTRAIN_TEST_COSTS"):
            report = json.dumps(dict(sorted(self.costs.items())), indent=1) + "\n"
            Path(os.environ["BIGTRAIN_TEST_COSTS"]).write_text(report)
        if self.problems and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter, config):
        if hasattr(config, "workerinput") or not self.costs:
            return
        for line in self.problems:
            terminalreporter.write_line(line, red=True, bold=True)
        costliest = sorted(self.costs, key=self.costs.get, reverse=True)[:5]
        terminalreporter.write_line("test files' CPU seconds against their budgets (tests/budgets.py): " + ", ".join(
            f"{name.removeprefix('tests/')} {self.costs[name]:.0f}/{scale() * budget_of(name):.0f}"
            for name in costliest))
