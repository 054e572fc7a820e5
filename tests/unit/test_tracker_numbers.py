"""Code and docs speak to users: nothing in bigtrain/, docs/, scripts/, tests/ (but this file's examples) or README.md names a number in this project's
own tracker ("issue 38, sections 2-4", "the modes of issue 23", "#48"), which a user has no way to look up; name
what the thing is instead. Another project's tracker is fine when the project is named right before the number
("DeepSpeed issue 8262", "peft issue #297", "TRL #2985", "DeepSpeed's PR 7000"): a user can look those up."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from launch import REPO

# A number in a tracker: "issue 38", "Issues 31 and 39", "PR #12", an anchor's "issue-38", or a bare "#48" (not a
# colour such as #1f77b4, a URL's fragment or an HTML entity).
REFERENCE = re.compile(r"\b(?:issues?|PRs?|pull requests?)[\s-]*#?\d+\b|(?<![\w/&#])#\d+\b", re.IGNORECASE)
# The projects whose trackers the code and docs may cite, lower-cased; add one here when you cite its tracker.
UPSTREAM = {"deepspeed", "peft", "trl", "transformers", "accelerate", "datasets", "tokenizers", "safetensors",
            "torch", "pytorch", "triton", "lm-eval", "lm-evaluation-harness", "vllm", "megatron", "megatron-lm",
            "nanogpt", "llm.c", "ray", "numpy", "python", "cpython", "glibc", "mkdocs", "pytest", "pytest-xdist",
            "huggingface_hub", "liger-kernel", "flash-attention"}
PROJECT_BEFORE = re.compile(r"([\w.\-]+)(?:'s)?\s*$")
SCANNED = [REPO / "README.md", REPO / "bigtrain", REPO / "docs", REPO / "scripts", REPO / "tests"]


def tracker_numbers(text: str) -> list[re.Match]:
    """Each reference in `text` to a tracker number that no upstream project's name right before it claims (on the
    line before too: a docstring may wrap between the two)."""
    found = []
    for match in REFERENCE.finditer(text):
        before = PROJECT_BEFORE.search(text[max(0, match.start() - 60):match.start()])
        if before is None or before.group(1).lower() not in UPSTREAM:
            found.append(match)
    return found


def scanned_files() -> list[Path]:
    files = []
    for root in SCANNED:
        for path in sorted([root] if root.is_file() else root.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path != Path(__file__).resolve():
                files.append(path)
    return files


@pytest.mark.parametrize("text, expected", [
    ('"""Online RL\'s building blocks (issue 38, sections 2-4): generation', ["issue 38"]),
    ("# pipeline stages, and the modes of issue 23.", ["issue 23"]),
    ("## Preparing data (issue 15)", ["issue 15"]),
    ("Issue 39's aims on these figures:", ["Issue 39"]),
    ("What ALST's levers buy (issues 31 and 39), on", ["issues 31"]),
    ("a fix for that (#48), then", ["#48"]),
    ("see [Benchmarks](benchmarks.md#online-rl-issue-38-a-grpo-step)", ["issue-38"]),
    ("landed in PR 12 of ours", ["PR 12"]),
])
def test_a_tracker_number_of_our_own_is_found(text, expected):
    assert [m.group(0) for m in tracker_numbers(text)] == expected


@pytest.mark.parametrize("text", [
    "waiting in that gather for ever (DeepSpeed issue 8262). It masks",
    "merges into empty placeholders (peft issue #297) unless",
    "TRL's default since TRL #2985 and",
    "as DeepSpeed's PR 7000 did",
    "set the colour to #1f77b4 and the anchor to page.md#section-2",
    "to file an issue.",
    "&#39; is a quote",
    "a gather that hangs (DeepSpeed\nissue 8262)",
])
def test_another_projects_tracker_and_ordinary_text_pass(text):
    assert tracker_numbers(text) == []


def test_no_tracker_number_in_the_code_or_the_docs():
    files = scanned_files()
    assert any(p.name == "benchmarks.md" for p in files) and any(p.suffix == ".py" for p in files)
    found = []
    for path in files:
        try:
            text = path.read_text()
        except UnicodeDecodeError:  # images
            continue
        found += [f"{path.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
                  for m in tracker_numbers(text)]
    assert not found, ("these name a number in this project's tracker, which a user cannot look up; say what the "
                       "thing is instead (another project's issue names the project right before it, as in "
                       "'DeepSpeed issue 8262', with the project in this test's UPSTREAM):\n" + "\n".join(found))
