"""The record formats of chat and instruction data: their names, their columns, and the data.* options that go with
them (no tokenizer, no torch: the run config and prepare's command line read them).

    chat               {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}
    sharegpt           {"conversations": [{"from": "system" | "human" | "gpt", "value": "..."}, ...]}
    prompt_completion  {"prompt": "...", "completion": "..."}
    alpaca             {"instruction": "...", "input": "..." (optional), "output": "..."}

and the preference records of TRL's DPO/reward trainers and LLaMA-Factory (two examples each: the chosen answer's,
then the rejected one's), and TRL's unpaired records for KTO (one answer each, marked desirable or not):

    preference              {"prompt": ..., "chosen": ..., "rejected": ...}: strings, or message lists (the prompt
                            a list or a string for the user; without a prompt, the turns the two conversations
                            share are the prompt: TRL's implicit prompt)
    preference_instruction  {"instruction": "...", "input": "..." (optional), "chosen": "...", "rejected": "..."}
    kto                     {"prompt": ..., "completion": ..., "label": true | false}: strings, or message lists

and the prompt-only records of online RL (TRL's GRPO/RLOO/distillation trainers), whose other columns (an
"answer", say) are kept whole for the reward functions (bigtrain.data.prompts); never detected, only named:

    prompt                  {"prompt": "..." | [messages], ...any other columns}

Which format a source holds is read from its first record (`bigtrain.data.sources.detect_format`); how an example
becomes tokens is `bigtrain.data.chat`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

FORMATS = ("auto", "text", "chat", "sharegpt", "prompt_completion", "alpaca", "preference", "preference_instruction",
           "kto", "prompt")
PAIR_FORMATS = ("preference_instruction", "preference")  # two examples per record: chosen, rejected
UNPAIRED_FORMATS = ("kto",)  # one answer per record, marked desirable or not
PROMPT_FORMATS = ("prompt",)  # a prompt to generate from, every column kept (not in EXAMPLE_FORMATS: not detected)
ALL_COLUMNS = "*?"  # in FIELDS: every column of the record is read, not only the named ones
UNDESIRABLE = 2  # the mask value of an undesirable answer's tokens (a desirable one's are 1)
# In the order a record's keys are matched (a preference record's keys first: they hold a prompt too).
EXAMPLE_FORMATS = (*PAIR_FORMATS, *UNPAIRED_FORMATS, "chat", "sharegpt", "prompt_completion", "alpaca")
TEMPLATED = ("chat", "sharegpt")  # conversations, rendered by the tokenizer's chat template
PLAIN = ("prompt_completion", "alpaca", "preference_instruction")  # text records, rendered as plain text
# how a run's data put its prompts to the model (`prompt_rendering`), which `bigtrain generate` and `chat` follow
CHAT_TEMPLATE, PLAIN_TEXT = "chat_template", "text"
LONG_EXAMPLES = ("truncate", "drop")
# The columns of each format; "?" marks an optional one (read where present).
FIELDS: dict[str, tuple[str, ...]] = {"chat": ("messages", "tools?"), "sharegpt": ("conversations",),
                                      "prompt_completion": ("prompt", "completion"),
                                      "alpaca": ("instruction", "input?", "output"),
                                      "preference": ("prompt?", "chosen", "rejected"),
                                      "preference_instruction": ("instruction", "input?", "chosen", "rejected"),
                                      "kto": ("prompt", "completion", "label"), "prompt": ("prompt", ALL_COLUMNS)}


@dataclass(frozen=True)
class ExampleOptions:
    """The data.* settings of chat and instruction data (see the run config's docs)."""

    format: str = "auto"
    chat_template: str | None = None
    train_on_prompt: bool = False
    long_examples: str = "truncate"
    packing: bool = False
    prompt_tokens: int | None = None  # prompt records: the longest prompt kept (seq_len - max_completion_length)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"data.format={self.format!r}: must be one of {', '.join(FORMATS)}")
        if self.long_examples not in LONG_EXAMPLES:
            raise ValueError(f"data.long_examples={self.long_examples!r}: must be truncate or drop")


def required(fields: Iterable[str]) -> list[str]:
    return [f for f in fields if not f.endswith("?")]


def columns(fields: Iterable[str]) -> list[str]:
    return [f.rstrip("?") for f in fields]


def prompt_rendering(corpora: Iterable[Any]) -> str | None:
    """How prepared corpora (`bigtrain.data.prepare.store.PreparedCorpus`) put their prompts to the model:
    CHAT_TEMPLATE when every example went through the tokenizer's chat template, PLAIN_TEXT when none did (plain-text
    records, or documents); None when they were mixed, or a corpus an older bigtrain prepared does not say."""
    seen: set[str | None] = set()
    for corpus in corpora:
        examples = corpus.examples
        if not examples:
            seen.add(PLAIN_TEXT)
            continue
        plain = examples.get("plain_examples")  # prepare counts them (`bigtrain.data.chat.Renderer`)
        if plain is None:
            fmt = examples["format"]
            seen.add(CHAT_TEMPLATE if fmt in TEMPLATED else PLAIN_TEXT if fmt in PLAIN else None)
        else:
            seen.add(PLAIN_TEXT if plain == corpus.manifest["num_docs"] else CHAT_TEMPLATE if plain == 0 else None)
    return seen.pop() if len(seen) == 1 else None


def format_of(keys: Iterable[str]) -> str:
    """The example format whose required fields the keys hold ('text' when none), as TRL recognises them."""
    keys = set(keys)
    return next((fmt for fmt in EXAMPLE_FORMATS if set(required(FIELDS[fmt])) <= keys), "text")


def record_shapes(formats: Iterable[str]) -> str:
    """The fields each of `formats` requires, as a line names them: 'messages', 'prompt' + 'completion', ..."""
    return ", ".join(" + ".join(repr(c) for c in required(FIELDS[f])) for f in formats)


def no_text_field_line(field: str, where: str, keys: Any) -> str:
    """Plain-text records without their text field: name what they hold, the text field to set, and the record
    shapes that train as chat or instruction examples instead."""
    shapes = record_shapes(EXAMPLE_FORMATS)
    return (f"data.text_field={field!r}: {where} has no such field; it has {keys}. Set data.text_field (prepare "
            f"--text-field) to the one holding the text, or for chat / instruction examples give records with "
            f"{shapes} (data.format)")


def layout_of(fmt: str) -> str:
    """How a format's records train (bigtrain.data.dataset.LAYOUTS): pairs, unpaired answers, prompts, or rows."""
    return ("pairs" if fmt in PAIR_FORMATS else "unpaired" if fmt in UNPAIRED_FORMATS else "prompts"
            if fmt in PROMPT_FORMATS else "rows")


def layout_formats(layout: str) -> list[str]:
    """The record formats that train as `layout`."""
    return [fmt for fmt in FIELDS if layout_of(fmt) == layout]


def missing_fields(keys: Iterable[str], formats: Iterable[str]) -> list[str]:
    """The required fields that records with `keys` lack for the nearest of `formats` (the one they hold most of)."""
    keys = set(keys)
    gaps = [[f for f in required(FIELDS[fmt]) if f not in keys] for fmt in formats]
    return min(gaps, key=len) if gaps else []
