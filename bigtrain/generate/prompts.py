"""The prompts of `bigtrain generate`: --prompt (repeatable) and --prompts-file, a text file (one prompt a line) or
JSON lines ({"prompt": TEXT} or {"messages": [{"role", "content"}, ...]}, a conversation to continue)."""
from __future__ import annotations

import json
from pathlib import Path

Prompt = str | list  # text, or a conversation (messages)


def read_prompts(texts: list[str], path: str | None) -> list[Prompt]:
    """Every prompt, --prompt's first; ValueError (one line) for none, or a file it cannot read."""
    prompts: list[Prompt] = list(texts)
    if path is not None:
        prompts += _from_file(Path(path).expanduser())
    if not prompts:
        raise ValueError("no prompt: give --prompt TEXT (repeatable) or --prompts-file FILE (a prompt a line, or "
                         "JSON lines of {\"prompt\": ...} or {\"messages\": [...]}); `bigtrain chat` talks")
    return prompts


def _from_file(path: Path) -> list[Prompt]:
    if not path.is_file():
        raise ValueError(f"--prompts-file {path}: no such file")
    lines = path.read_text().splitlines()
    if path.suffix not in (".jsonl", ".json"):
        return [line for line in lines if line.strip()]
    prompts: list[Prompt] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not JSON ({err.msg}); give one {{\"prompt\": ...}} or "
                             "{\"messages\": [...]} per line") from None
        prompts.append(_record_prompt(record, f"{path}:{number}"))
    return prompts


def _record_prompt(record: object, where: str) -> Prompt:
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return record["prompt"]
    messages = record.get("messages") if isinstance(record, dict) else None
    if isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        return messages
    raise ValueError(f"{where}: give {{\"prompt\": TEXT}} or {{\"messages\": [{{\"role\": ..., \"content\": ...}}, "
                     f"...]}}; this line has {sorted(record) if isinstance(record, dict) else type(record).__name__}")


def shown(prompt: Prompt) -> str:
    """The prompt in one line, for a header."""
    text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    text = " ".join(text.split())
    return text if len(text) <= 60 else text[:59] + "…"
