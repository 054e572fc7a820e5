"""The suite's time budget (tests/budget.py, tests/budgets.py): a test file that costs more CPU seconds than its line
fails the session with a line naming it, alone and under pytest-xdist; one within its line passes; every listed file
exists."""
from __future__ import annotations

from pathlib import Path

import pytest

import budgets
from budgets import DEFAULT, TIERS, budget_of, over_budget

pytest_plugins = ["pytester"]
TESTS = Path(__file__).resolve().parents[1]

BURN = """
import time

def test_burns_cpu():
    end = time.process_time() + 0.6  # CPU, not sleep: a sleeping test costs nothing
    while time.process_time() < end:
        pass

def test_cheap():
    pass
"""


def test_a_file_over_its_line_is_named_with_both_figures():
    costs = {"tests/dist/test_levers.py": 10_000.0, "tests/unit/test_new.py": DEFAULT["tests/unit/"] - 1}
    (line,) = over_budget(costs)
    assert line.startswith("tests/dist/test_levers.py: 10000 CPU seconds, over its budget of ")
    assert "tests/budgets.py" in line
    assert over_budget({"tests/unit/test_new.py": DEFAULT["tests/unit/"] + 1}) != []  # a new file: its tier's line
    assert over_budget({"tests/unit/test_new.py": DEFAULT["tests/unit/"] + 1}, scale=2) == []
    files = int(TIERS["tests/unit/"] // (DEFAULT["tests/unit/"] - 1)) + 2  # together past the tier's line
    many = {f"tests/unit/test_{i}.py": DEFAULT["tests/unit/"] - 1 for i in range(files)}  # each within its line
    (line,) = over_budget(many)
    assert line.startswith("tests/unit/: ") and f"over the tier's budget of {TIERS['tests/unit/']:.0f}" in line


def test_every_budgeted_file_exists():
    root = TESTS.parent
    assert [name for name in budgets.BUDGETS if not (root / name).is_file()] == []
    assert all(budget_of(name) > 0 for name in budgets.BUDGETS)


def test_a_file_past_its_budget_fails_the_session_and_one_within_it_passes(pytester, monkeypatch):
    """Under pytest-xdist (the workers measure, the controller adds up) and alone; the budgets scaled so that the
    file's 0.6 CPU seconds are past its line in the first session (12 x 0.01) and within it in the second (x 100).
    Both sessions run in this process (the xdist workers in their own), each with its own accounting."""
    pytester.makeconftest(f"import sys\nsys.path.insert(0, {str(TESTS)!r})\npytest_plugins = ['budget']\n")
    pytester.mkpydir("tests")
    pytester.mkpydir("tests/unit")
    (pytester.path / "tests" / "unit" / "test_burn.py").write_text(BURN)
    # by path: with the repository on PYTHONPATH, its own tests package would shadow this one's
    args = ["-p", "no:cacheprovider", "--import-mode=importlib"]

    monkeypatch.setenv("BIGTRAIN_TEST_BUDGET_SCALE", "0.01")
    run = pytester.runpytest(*args, "-n", "2")
    assert run.ret == pytest.ExitCode.TESTS_FAILED, run.stdout.str()
    run.assert_outcomes(passed=2)  # every test passed: the file's cost failed the session
    run.stdout.fnmatch_lines(["tests/unit/test_burn.py: * CPU seconds, over its budget of 0 (tests/budgets.py)*"])

    monkeypatch.setenv("BIGTRAIN_TEST_BUDGET_SCALE", "100")
    run = pytester.runpytest(*args)
    assert run.ret == pytest.ExitCode.OK, run.stdout.str()
    run.stdout.fnmatch_lines([f"*test files' CPU seconds against their budgets*unit/test_burn.py */"
                              f"{100 * DEFAULT['tests/unit/']:.0f}*"])
