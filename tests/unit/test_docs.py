"""The docs cannot drift from the code: every `bigtrain ...`, `bigtrain/run.py ...` and `deepspeed ... bigtrain/run.py
...` command in README.md and docs/*.md (code blocks and inline code) uses only flags the argparse parsers have, and
every `--set KEY=VALUE` names a field of the run config; the site builds with `mkdocs build --strict`; the README
stays a front page."""
from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest

from launch import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUN_MODULE = "bigtrain.run"


@dataclasses.dataclass(frozen=True)
class Command:
    where: str  # file:line
    kind: str  # "verb" (bigtrain VERB ...) or "run" (bigtrain/run.py, --module bigtrain.run)
    tokens: list[str]  # what follows `bigtrain` or run.py


def code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, text) of what may hold a command: lines of fenced and indented code blocks (continued lines
    joined), and each inline code span."""
    found, fence, pending = [], None, ""
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip()
            continue
        if (fence is not None and fence in ("", "bash", "sh", "shell", "console")) or line.startswith("    "):
            pending += " " + stripped
            if pending.endswith("\\"):
                pending = pending[:-1]
                continue
            found.append((number, pending.strip()))
            pending = ""
        elif fence is None:
            found += [(number, span) for span in re.findall(r"`([^`]+)`", line)]
    return found


def commands(path: Path, text: str | None = None) -> list[Command]:
    out = []
    for number, line in code_lines(path.read_text() if text is None else text):
        try:
            tokens = shlex.split(line.replace("\\|", "|"), comments=True)
        except ValueError:  # an inline span with one quote of a pair
            tokens = line.split()
        tokens = [t.strip("[]") for t in tokens]
        where = f"{path.relative_to(REPO)}:{number}"
        for i, token in enumerate(tokens):
            if Path(token).name == "bigtrain" and i + 1 < len(tokens) and tokens[i + 1] != "..." \
                    and not tokens[i + 1].startswith("-"):
                out.append(Command(where, "verb", tokens[i + 1:]))
                break
            if token.endswith("bigtrain/run.py") or (token == RUN_MODULE and tokens[i - 1] in ("--module", "-m")):
                out.append(Command(where, "run", tokens[i + 1:]))
                break
    return out


def parsers() -> tuple[dict[str, argparse.ArgumentParser], argparse.ArgumentParser]:
    from bigtrain.cli import build_parser
    from bigtrain.config.flags import build_run_parser
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices), build_run_parser()


def knows(parser: argparse.ArgumentParser, flag: str) -> bool:
    return parser.known_spellings([flag])[0] in parser._option_string_actions


def run_config_key_problem(key: str) -> str | None:
    """None when `key` names a run-config field (a dict field takes any keys below it; an all-capitals segment is a
    placeholder such as SECTION.FIELD or model.overrides.KEY), else what is wrong."""
    from bigtrain.config.run_config import RunConfig
    node: typing.Any = RunConfig
    for depth, part in enumerate(key.split(".")):
        if part.isupper() or node is dict:
            return None
        if not dataclasses.is_dataclass(node):
            return f"{'.'.join(key.split('.')[:depth])} is a value, not a section"
        hints = typing.get_type_hints(node)
        if part not in hints:
            return f"no field {part!r} in {node.__name__}"
        node = hints[part]
        if typing.get_origin(node) in (typing.Union, types.UnionType):
            node = next(a for a in typing.get_args(node) if a is not type(None))
        node = dict if node is dict or typing.get_origin(node) is dict else node
    return None if not dataclasses.is_dataclass(node) else f"{key} is a section, not a field"


def problems(command: Command, verbs: dict, run_parser: argparse.ArgumentParser) -> list[str]:
    tokens = command.tokens
    if command.kind == "verb":
        verb, tokens = tokens[0], tokens[1:]
        if verb not in verbs:
            return [f"{command.where}: bigtrain has no verb {verb!r}"]
        parser = verbs[verb]
        takes_run_flags = verb in ("train", "ray-train", "tune")  # what they do not know goes to run.py
        known = [parser] + ([run_parser] if takes_run_flags else [])
        where = f"bigtrain {verb}"
    else:
        known, where = [run_parser], "bigtrain/run.py"
    found = []
    for i, token in enumerate(tokens):
        if token == "--":
            break
        if not token.startswith("--") or token == "--":
            continue
        flag = token.split("=", 1)[0]
        if not any(knows(p, flag) for p in known):
            found.append(f"{command.where}: {where} has no flag {flag}")
        if flag == "--set":
            item = token.split("=", 1)[1] if "=" in token else (tokens[i + 1] if i + 1 < len(tokens) else "")
            key = item.split("=", 1)[0]
            if key not in ("...", "") and (problem := run_config_key_problem(key)):
                found.append(f"{command.where}: --set {key}: {problem}")
    return found


def test_every_command_in_the_docs_uses_flags_and_keys_that_exist():
    verbs, run_parser = parsers()
    found = [c for page in PAGES for c in commands(page)]
    assert len(found) > 40 and {c.kind for c in found} == {"verb", "run"}  # the reader reads them
    verbs_used = {c.tokens[0] for c in found if c.kind == "verb"}
    assert {"train", "eval", "export", "generate", "chat", "recipes"} <= verbs_used, verbs_used
    wrong = [p for c in found for p in problems(c, verbs, run_parser)]
    assert not wrong, "\n".join(wrong)


def test_every_set_in_the_docs_names_a_run_config_field():
    """`--set KEY=VALUE` spans in prose too (the flag tables)."""
    wrong = []
    for page in PAGES:
        for number, span in code_lines(page.read_text()):
            for key in re.findall(r"--set[ =]([A-Za-z_][\w.]*)=", span):
                if problem := run_config_key_problem(key):
                    wrong.append(f"{page.relative_to(REPO)}:{number}: --set {key}: {problem}")
    assert not wrong, "\n".join(wrong)


def test_the_reader_finds_what_is_wrong():
    verbs, run_parser = parsers()
    text = ("```bash\ndeepspeed --num_gpus 2 bigtrain/run.py --size tiny --stepz 3 \\\n    --set zero.stag=3\n```\n"
            "Run `bigtrain estimate --model gpt2 --set model.overrides.n_layer=2 --gpu-memory 80` or "
            "`bigtrain train --steps 3 --set data.seq_len.x=1`; `bigtrain evaluate --x`; "
            "`bigtrain generate runs/x --max-tokens 5`; `bigtrain chat Qwen/Qwen3-8B --temprature 0.7`.\n")
    wrong = [p for c in commands(REPO / "docs" / "check.md", text) for p in problems(c, verbs, run_parser)]
    assert [w.split(": ", 1)[1] for w in wrong] == [
        "bigtrain/run.py has no flag --stepz", "--set zero.stag: no field 'stag' in ZeroConfig",
        "bigtrain estimate has no flag --gpu-memory", "--set data.seq_len.x: data.seq_len is a value, not a section",
        "bigtrain has no verb 'evaluate'", "bigtrain generate has no flag --max-tokens",
        "bigtrain chat has no flag --temprature"], wrong


def test_the_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move reference text into docs/"
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", "\n".join(lines)))
    pages = {p.name for p in (REPO / "docs").glob("*.md")} - {"index.md"}
    assert pages <= linked, f"pages the README does not link: {sorted(pages - linked)}"


def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the [docs] extra: pip install -e '.[docs]'")
    pytest.importorskip("material", reason="the [docs] extra: pip install -e '.[docs]'")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env={"NO_MKDOCS_2_WARNING": "1",
                                                                                      "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    built = {p.parent.name for p in (tmp_path / "site").rglob("index.html")}
    assert {"training", "data", "benchmarks", "layout"} <= built
    nav = {line.split(": ")[-1].strip() for line in (REPO / "mkdocs.yml").read_text().splitlines()
           if line.strip().startswith("- ") and line.strip().endswith(".md")}
    assert nav == {p.name for p in (REPO / "docs").glob("*.md")}, "every page in the nav, and only pages that exist"
