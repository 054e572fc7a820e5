"""The reward functions a user names without writing code (objective.rewards):

    accuracy          1.0 when the completion's final answer equals the record's `answer` column, else 0.0; None
                      (the completion is skipped) where the record has no answer. The final answer is the last
                      \\boxed{...} (LaTeX), else what follows "####" (GSM8K), else "answer is ...", else the last
                      number; numbers compare as numbers ("1,000" == "1000.0" == "1e3", "\\frac{1}{2}" == "0.5",
                      "50%" == "50"), anything else as text (case, spaces, $...$ and \\text{} ignored)
    format[=REGEX]    1.0 when the completion matches REGEX from its start (re.match, DOTALL | MULTILINE), else 0.0;
                      by default TRL's think_format_reward: one <think> ... </think> block first
    length[=MAX[,CACHE]]  DAPO's soft overlong punishment (eq. 13, TRL's get_soft_overlong_punishment): 0 up to
                      MAX - CACHE tokens, falling linearly to -1 at MAX, -1 beyond (MAX:
                      objective.max_completion_length, CACHE: MAX // 4 unless given)

Each takes TRL's keywords (prompts, completions, completion_ids, the record's columns) and returns one float or
None per completion. No math_verify here (TRL's accuracy_reward needs it): a symbolic check is a reward function
a user can import by name.
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable

THINK_FORMAT = r"^<think>(?!.*<think>)(.*?)</think>.*$"  # TRL's think_format_reward
_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*(?:[eE][-+]?\d+)?|-?\.\d+")
_FRACTION = re.compile(r"^\\d?frac\{([^{}]+)\}\{([^{}]+)\}$")


def completion_text(completion: Any) -> str:
    """A completion as text: a string, or (conversational prompts) a list of one assistant message."""
    if isinstance(completion, list):
        return "".join(m.get("content") or "" for m in completion if isinstance(m, dict))
    return str(completion)


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None when there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, out = 1, []
    while i < len(text):
        ch = text[i]
        depth += ch == "{"
        depth -= ch == "}"
        if depth == 0:
            return "".join(out)
        out.append(ch)
        i += 1
    return None  # unclosed


def final_answer(text: str) -> str | None:
    """The answer a completion (or a reference solution) ends with; None when it gives none."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0] if tail else None
    said = re.findall(r"answer is[:\s]*([^\n]+)", text, flags=re.IGNORECASE)
    if said:
        return said[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _strip_latex(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = re.sub(r"^\\\(|\\\)$", "", s).strip()
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\(left|right|!|,|;|quad)", "", s)
    return s.rstrip(".").strip()


def as_number(answer: str) -> float | None:
    """The number an answer states, or None: commas between digits, a leading $ and a trailing % are dropped;
    \\frac{a}{b} and a/b are divided."""
    s = _strip_latex(answer).replace("\\%", "%").replace(" ", "")
    s = s.removeprefix("\\$").removeprefix("$").removesuffix("%")
    fraction = _FRACTION.match(s)
    parts = fraction.groups() if fraction else s.split("/") if s.count("/") == 1 else None
    if parts:
        num, den = as_number(parts[0]), as_number(parts[1])
        return num / den if num is not None and den not in (None, 0.0) else None
    if not re.fullmatch(r"[-+]?(\d{1,3}(,\d{3})+|\d*)(\.\d*)?([eE][-+]?\d+)?", s) or not re.search(r"\d", s):
        return None
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def answers_match(predicted: str, gold: str) -> bool:
    """Whether two final answers are the same: as numbers when both are numbers, else as normalised text."""
    a, b = as_number(predicted), as_number(gold)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    norm = lambda s: re.sub(r"\s+", "", _strip_latex(s)).lower()  # noqa: E731
    return norm(predicted) == norm(gold)


def accuracy(completions: list, answer: list | None = None, **kwargs: Any) -> list[float | None]:
    """1.0 / 0.0: does the completion's final answer equal the record's `answer`? None where there is none."""
    if answer is None:
        raise ValueError("the accuracy reward compares with each record's 'answer' column, and these records have "
                         "none: add an 'answer' to the records, or name another reward")
    scores: list[float | None] = []
    for completion, gold in zip(completions, answer):
        if gold is None or str(gold).strip() == "":
            scores.append(None)
            continue
        gold_text = str(gold)
        gold_final = final_answer(gold_text) if ("\\boxed" in gold_text or "####" in gold_text) else gold_text
        predicted = final_answer(completion_text(completion))
        scores.append(float(predicted is not None and gold_final is not None and answers_match(predicted, gold_final)))
    return scores


def format_reward(pattern: str = THINK_FORMAT) -> Callable[..., list[float]]:
    """1.0 / 0.0: does the completion match `pattern` from its start?"""
    try:
        compiled = re.compile(pattern, re.DOTALL | re.MULTILINE)
    except re.error as e:
        raise ValueError(f"objective.rewards format={pattern!r}: not a regular expression ({e})") from None

    def format(completions: list, **kwargs: Any) -> list[float]:  # noqa: A001 -- its metric name
        return [float(compiled.match(completion_text(c)) is not None) for c in completions]
    return format


def length_reward(max_tokens: int, cache: int | None = None) -> Callable[..., list[float]]:
    """DAPO's soft overlong punishment over completion_ids' lengths (see the module's docstring)."""
    cache = max(1, max_tokens // 4) if cache is None else cache
    if not 0 < cache <= max_tokens:
        raise ValueError(f"objective.rewards length={max_tokens},{cache}: need 0 < CACHE <= MAX")

    def length(completion_ids: list, **kwargs: Any) -> list[float]:
        out = []
        for ids in completion_ids:
            n = len(ids)
            out.append(0.0 if n <= max_tokens - cache else (max_tokens - cache - n) / cache if n <= max_tokens
                       else -1.0)
        return out
    return length


def builtin(spec: str, max_completion_length: int) -> Callable[..., list] | None:
    """The built-in a spec names ("accuracy", "format=^<answer>", "length=512,64"), or None when it names none."""
    name, _, arg = spec.partition("=")
    if name == "accuracy" and not arg:
        return accuracy
    if name == "format":
        return format_reward(arg) if arg else format_reward()
    if name == "length":
        if not arg:
            return length_reward(max_completion_length)
        try:
            values = [int(v) for v in arg.split(",")]
        except ValueError:
            values = []
        if len(values) not in (1, 2):
            raise ValueError(f"objective.rewards {spec!r}: give length, length=MAX or length=MAX,CACHE (tokens)")
        return length_reward(*values)
    return None
