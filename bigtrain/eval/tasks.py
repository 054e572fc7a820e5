"""Which lm-eval tasks to run: names checked against lm-eval's index and local task folders, data loaded up front.

Every problem is one line naming the task: an unknown name (with the nearest known names), a local folder that
does not exist, a task whose data cannot be had here (not in the Hugging Face cache, no network, a local file
gone), with what makes it available. `include_flag` names where the local folders came from in those lines:
`bigtrain eval --include-path`, or a run's `train.eval_include_path`.
"""
from __future__ import annotations

import difflib
import importlib.util
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from bigtrain.eval.harness import require_lm_eval

DOCS = "docs/evaluation.md, 'A local task'"
INCLUDE_FLAG = "--include-path"
# a task's, group's or tag's name as task YAML files write it: `task: NAME`, `group: NAME`, `tag: NAME` or a list item
NAME_LINE = re.compile(rb"^\s*(?:(?:task|group|tag)\s*:|-)\s*[\"']?([\w.-]+)[\"']?\s*$", re.MULTILINE)


@dataclass
class TaskSet:
    """The task manager (its index of task names) and the loaded tasks, ready for `simple_evaluate`."""

    names: list[str]
    manager: Any  # lm_eval.tasks.TaskManager
    task_dict: dict  # what lm_eval.tasks.get_task_dict returned: tasks with their documents loaded


def split_names(tasks: str | Sequence[str]) -> list[str]:
    """'a,b' or ['a', 'b'] -> ['a', 'b'] (blanks dropped); ValueError when nothing is left."""
    parts = tasks.split(",") if isinstance(tasks, str) else [p for t in tasks for p in str(t).split(",")]
    names = [p.strip() for p in parts if p.strip()]
    if not names:
        raise ValueError("no task given: name lm-eval tasks, e.g. --tasks hellaswag,arc_easy (or a local task "
                         f"folder's tasks with --include-path DIR; {DOCS})")
    return names


def task_manager(include_path: str | Path | Sequence[str | Path] | None = None,
                 names: Sequence[str] = (), include_flag: str = INCLUDE_FLAG) -> Any:
    """lm-eval's TaskManager over the local task folders in `include_path` and lm-eval's own tasks; over the local
    folders alone when they hold every one of `names` (indexing lm-eval's ~15000 task files takes 8-40 s here)."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager
    folders = task_folders(include_path, include_flag)
    with quiet_lm_eval():
        if folders and names:
            local = TaskManager(include_path=folders, include_defaults=False)
            if all(name in set(local.all_tasks) for name in names):
                return local
        return TaskManager(include_path=folders or None)


def task_folders(include_path: str | Path | Sequence[str | Path] | None, include_flag: str = INCLUDE_FLAG) -> list[str]:
    """The local task folders, resolved; ValueError (one line) for one that does not exist."""
    paths = [include_path] if isinstance(include_path, (str, Path)) else list(include_path or [])
    for path in paths:
        if not Path(path).expanduser().is_dir():
            raise ValueError(f"{include_flag} {path}: no such directory; give a folder of lm-eval task YAML files "
                             f"({DOCS})")
    return [str(Path(p).expanduser().resolve()) for p in paths]


def check_task_names(names: Sequence[str], include_path: Any = None, include_flag: str = INCLUDE_FLAG) -> None:
    """`load_tasks`' line for a name no task file defines, in about a second, without lm-eval's index (reading its
    ~14000 task files takes 8-40 s here): every task, group and tag name lm-eval knows is written in one of those YAML
    files or the local folders' (its TaskIndex reads them from there), so a name that is no word of any of them is
    none; the nearest names come from the files' `task:`, `group:` and `tag:` lines. A name that is such a word is
    left to `load_tasks`, which the ranks run with the data."""
    require_lm_eval()
    folders = task_folders(include_path, include_flag)
    spec = importlib.util.find_spec("lm_eval")
    roots = [Path(p) / "tasks" for p in (spec.submodule_search_locations or [])] if spec else []
    text = b"\n".join(p.read_bytes() for root in [*roots, *map(Path, folders)] for p in root.rglob("*.yaml"))
    for name in names:
        if Path(name).is_file() or re.search(rb"(?<![\w.-])" + re.escape(name.encode()) + rb"(?![\w.-])", text):
            continue
        written = {m.decode(errors="replace") for m in NAME_LINE.findall(text)}
        raise ValueError(unknown_task_line(name, sorted(written), folders, include_flag))


def check_known(names: Sequence[str], manager: Any, include_flag: str = INCLUDE_FLAG) -> None:
    """ValueError (one line, with the nearest names) for a name that is no task, group or tag of `manager`."""
    known = set(manager.all_tasks)
    for name in names:
        if name not in known and not Path(name).is_file():
            raise ValueError(unknown_task_line(name, manager.all_tasks, manager.include_path, include_flag))


def load_tasks(names: Sequence[str], manager: Any, num_fewshot: int | None = None,
               include_flag: str = INCLUDE_FLAG) -> TaskSet:
    """The tasks `names` with their data; ValueError (one line) for an unknown name or data that cannot be had."""
    check_known(names, manager, include_flag)
    from lm_eval.tasks import get_task_dict
    task_dict: dict = {}
    for name in names:  # one at a time: a failure names its task
        try:
            with quiet_lm_eval():
                task_dict.update(get_task_dict([name], manager))
        except Exception as err:  # noqa: BLE001 -- datasets raises many types; each becomes the line below
            raise ValueError(data_unavailable_line(name, err)) from None
    return TaskSet(list(names), manager, task_dict)


def unknown_task_line(name: str, known: Sequence[str], include_path: Any = None,
                      include_flag: str = INCLUDE_FLAG) -> str:
    """One line: the name is no task lm-eval knows, the nearest names it does, and where local tasks come from."""
    near = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    hint = f"; nearest: {', '.join(near)}" if near else ""
    given = f"{include_flag}=DIR" if include_flag.startswith("train.") else f"{include_flag} DIR"
    where = "" if include_path else f"; a task of your own needs its folder: {given} ({DOCS})"
    folders = f" (nor one in the {include_flag} folder{'' if include_flag.startswith('train.') else 's'})" \
        if include_path else ""
    return f"unknown task {name!r}: no lm-eval task, group or tag{folders} has that name{hint}{where}"


def data_unavailable_line(name: str, err: BaseException) -> str:
    """One line: the task's data cannot be had, why (the library's first line), and how to make it available."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    reason = f"{type(err).__name__}: {first}"[:300]
    return (f"task {name}: its data cannot be loaded here ({reason}); download it once where the Hugging Face hub "
            f"is reachable (it is then read from the local cache, also with HF_DATASETS_OFFLINE=1), or write a "
            f"local task folder whose YAML reads your files (dataset_path: json, data_files; {DOCS})")


class quiet_lm_eval:
    """lm-eval logs every task it indexes and each metric default it fills at INFO/WARNING: kept off the console."""

    def __enter__(self) -> None:
        self.logger = logging.getLogger("lm_eval")
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)

    def __exit__(self, *exc: object) -> None:
        self.logger.setLevel(self.level)
