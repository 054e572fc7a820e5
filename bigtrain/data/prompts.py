"""Prompt-only records (data.format=prompt), the data of online RL: how a record's prompt becomes the tokens a
model generates after, as TRL's GRPOTrainer renders it.

    {"prompt": "What is 2+2?", "answer": "4", ...}                       plain text: the tokenizer's start tokens
                                                                         (a Llama BOS) + the text
    {"prompt": [{"role": "user", "content": "What is 2+2?"}], ...}      a conversation: the chat template with the
                                                                         generation prompt (the assistant's header);
                                                                         a last assistant turn is continued instead

Nothing of a prompt is trained on (its mask is all 0); the model's completion is what the objective scores. A
record may carry an answer too (`{"prompt": ..., "completion": "..." | [assistant messages]}`, TRL's
prompt-completion records): on-policy distillation trains a share of its steps on those answers instead of
sampled ones (`PromptRenderer.answer`: the answer's tokens as they follow the rendered prompt). The
record is kept whole, as one JSON line per prompt beside each prepared shard (`records` in
bigtrain.data.prepare.worker.shard_paths), because reward functions read its other columns by name (TRL passes
every column as a keyword). How prompts are served (cut or dropped when too long, left-padded) is
bigtrain.data.prompt_rows.

Imported by prepare's worker processes: transformers' tokenizer classes and Jinja, never torch.
"""
from __future__ import annotations

import json
from typing import Any

from bigtrain.data.chat import TEXT_MODEL_IMAGES, Renderer, chat_messages, no_template_line
from bigtrain.data.formats import PROMPT_FORMATS


class PromptRenderer:
    """record -> [(prompt token ids, all-zero mask)]; `record_line(record)` is what the shard keeps of it."""

    keeps_records = True  # the worker writes every record beside the tokens (see the module's docstring)

    def __init__(self, tokenizer: Any, fmt: str = "prompt"):
        assert fmt in PROMPT_FORMATS, fmt
        self.tok = tokenizer
        self.plain = Renderer(tokenizer, "prompt_completion")  # the start tokens and encoding of text records

    @property
    def plain_examples(self) -> int:
        """The prompts rendered as plain text (the others: conversations, through the chat template)."""
        return self.plain.plain_examples

    def examples(self, record: Any) -> list[tuple[list[int], list[int]]]:
        if isinstance(record, dict) and any(record.get(c) not in (None, []) for c in ("images", "image")):
            raise ValueError(TEXT_MODEL_IMAGES)
        ids = self.prompt_ids(record.get("prompt") if isinstance(record, dict) else None, record)
        return [(ids, [0] * len(ids))]

    def prompt_ids(self, prompt: Any, record: Any = None) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("a prompt record's 'prompt' is empty: give the text the model answers")
            ids, _ = self.plain({"prompt": prompt, "completion": ""})  # start tokens + the text + end-of-text
            return ids[:-1]
        if isinstance(prompt, list):
            return self._conversation(self.messages(prompt))
        if isinstance(record, dict) and "prompt" in record:
            raise ValueError(f"a prompt record's 'prompt' is {type(prompt).__name__}: give the text, or a list of "
                             "messages (data.format=prompt)")
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"a record has no 'prompt' (it has {keys}): give {{\"prompt\": \"...\" or [messages], "
                         "...other columns} (data.format=prompt)")

    def messages(self, messages: Any) -> list[dict]:
        """A prompt's messages, checked (`chat_messages`)."""
        return chat_messages(messages)

    def _conversation(self, messages: list[dict]) -> list[int]:
        from jinja2 import TemplateError
        if not getattr(self.tok, "chat_template", None):
            raise ValueError(no_template_line(self.tok).replace("data.format=chat", "data.format=prompt with "
                                                                                    "conversations"))
        continuing = messages[-1]["role"] == "assistant"  # TRL continues a final assistant turn
        try:
            text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=not continuing,
                                                continue_final_message=continuing)
        except TemplateError as e:
            raise ValueError(f"the chat template refused a prompt: {e}") from None
        return self.encode_prompt(text)

    def encode_prompt(self, text: str) -> list[int]:
        """A rendered prompt's tokens."""
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def answer(self, record: dict) -> tuple[list[int], list[int]]:
        """The tokens of the record's `completion` as they follow its prompt (a text answer and the end-of-text; an
        assistant turn as the chat template renders it after the generation prompt), and their mask (1 on what
        supervised fine-tuning would train: bigtrain.data.chat.Renderer's). One line when the record has none."""
        completion = record.get("completion") if isinstance(record, dict) else None
        if completion is None or (isinstance(completion, str) and not completion.strip()):
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"a prompt record has no answer in 'completion' (it has {keys}), which training on the "
                             "records' answers reads: give {\"prompt\": ..., \"completion\": \"...\" or [assistant "
                             "messages]}")
        prompt = record.get("prompt")
        if isinstance(prompt, list) and isinstance(completion, str):
            completion = [{"role": "assistant", "content": completion}]
        ids, mask = self.plain.answer({"prompt": prompt, "completion": completion}, "completion")
        start = mask.index(1) if 1 in mask else len(ids)  # the rendered prompt (a turn's header) ends there
        return ids[start:], mask[start:]

    @staticmethod
    def record_line(record: dict) -> str:
        """The record as one JSON line (values JSON does not know, as text)."""
        return json.dumps(record, ensure_ascii=False, default=str) + "\n"
