"""Which lm-eval tasks to run: names checked against lm-eval's index and local task folders, data loaded up front.

Every problem is one line naming the task: an unknown name (with the nearest known names), a local folder that
does not exist, a task whose data cannot be had here (not in the Hugging Face cache, no network, a local file
gone), with what makes it available.
"""
from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from bigtrain.eval.harness import require_lm_eval

DOCS = "docs/evaluation.md, 'A local task'"


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
                 names: Sequence[str] = ()) -> Any:
    """lm-eval's TaskManager over the local task folders in `include_path` and lm-eval's own tasks; over the local
    folders alone when they hold every one of `names` (indexing lm-eval's ~15000 task files takes ~8 s here)."""
    require_lm_eval()
    paths = [include_path] if isinstance(include_path, (str, Path)) else list(include_path or [])
    for path in paths:
        if not Path(path).expanduser().is_dir():
            raise ValueError(f"--include-path {path}: no such directory; give a folder of lm-eval task YAML files "
                             f"({DOCS})")
    from lm_eval.tasks import TaskManager
    folders = [str(Path(p).expanduser().resolve()) for p in paths]
    with quiet_lm_eval():
        if folders and names:
            local = TaskManager(include_path=folders, include_defaults=False)
            if all(name in set(local.all_tasks) for name in names):
                return local
        return TaskManager(include_path=folders or None)


def load_tasks(names: Sequence[str], manager: Any, num_fewshot: int | None = None) -> TaskSet:
    """The tasks `names` with their data; ValueError (one line) for an unknown name or data that cannot be had."""
    known = set(manager.all_tasks)
    for name in names:
        if name not in known and not Path(name).is_file():
            raise ValueError(unknown_task_line(name, manager.all_tasks, manager.include_path))
    from lm_eval.tasks import get_task_dict
    task_dict: dict = {}
    for name in names:  # one at a time: a failure names its task
        try:
            with quiet_lm_eval():
                task_dict.update(get_task_dict([name], manager))
        except Exception as err:  # noqa: BLE001 -- datasets raises many types; each becomes the line below
            raise ValueError(data_unavailable_line(name, err)) from None
    return TaskSet(list(names), manager, task_dict)


def unknown_task_line(name: str, known: Sequence[str], include_path: Any = None) -> str:
    """One line: the name is no task lm-eval knows, the nearest names it does, and where local tasks come from."""
    near = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    hint = f"; nearest: {', '.join(near)}" if near else ""
    where = "" if include_path else f"; a task of your own needs its folder: --include-path DIR ({DOCS})"
    folders = " (nor one in the --include-path folders)" if include_path else ""
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
