"""Chat and instruction examples: how a record (in one of the formats of `bigtrain.data.formats`, the shapes the
HF Trainer / TRL SFT trainer, axolotl, LLaMA-Factory and torchtune take) becomes tokens with its answer marked. A
preference pair renders to two examples (the chosen answer's, then the rejected one's; bigtrain.data.pairs serves
them side by side), a KTO record to one whose answer's mask is UNDESIRABLE (2) where its label is false.

An example renders to token ids and a 0/1 mask of the tokens the model is trained to produce: the assistant's
turns (their end-of-turn marker included: the model must learn to stop), the completion, the output (each
followed by the tokenizer's end-of-text). A conversation goes through the tokenizer's own chat template, as
`apply_chat_template` renders it for inference; prompt/completion pairs and Alpaca records are plain text.

Imported by prepare's worker processes: transformers' tokenizer classes and Jinja, never torch.
"""
from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bigtrain.data.formats import EXAMPLE_FORMATS, PAIR_FORMATS, TEMPLATED, UNDESIRABLE, UNPAIRED_FORMATS

# The roles chat templates render (transformers' docs; Llama 3's ipython, OpenAI's developer and function).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "ipython", "function")
# ShareGPT's speakers (as axolotl and LLaMA-Factory map them) -> chat roles.
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "tool": "tool",
                  "observation": "tool"}
# Stanford Alpaca's prompts (also axolotl's "alpaca" type), so a model fine-tuned here answers them as theirs do.
ALPACA_PROMPT = ("Below is an instruction that describes a task, paired with an input that provides further "
                 "context. Write a response that appropriately completes the request.\n\n"
                 "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_PROMPT_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately "
                          "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
TEXT_MODEL_IMAGES = ("the record carries images, and this model reads text only: train a vision-language model on it "
                     "(--model vlm --set model.pretrained=DIR, its processor beside it; docs/vision.md), or drop the "
                     "images")


def read_chat_template(value: str) -> str:
    """data.chat_template: a file holding a Jinja template, or the template itself."""
    path = Path(value).expanduser()
    if len(value) < 4096 and path.is_file():
        return path.read_text(encoding="utf-8")
    if "{%" in value or "{{" in value:
        return value
    raise ValueError(f"data.chat_template={value!r}: no such file, and not a Jinja template (it has no '{{%' or "
                     "'{{'); give a template file or the template text")


def has_generation_tags(template: str | None) -> bool:
    """Whether the template marks assistant text with {% generation %} (HF's return_assistant_tokens_mask)."""
    return bool(template) and bool(_GENERATION_TAG.search(template))


def record_text(record: Any) -> str:
    """Every string in a record, for training a BPE on examples (no tokenizer given)."""
    if isinstance(record, str):
        return record
    if isinstance(record, dict):
        return "\n".join(record_text(v) for v in record.values())
    if isinstance(record, list):
        return "\n".join(record_text(v) for v in record)
    return ""


class Renderer:
    """record -> (token ids, trained mask) for one example format and tokenizer; `plain_examples` counts the examples
    it rendered as plain text (the others went through the chat template): how the run asked its prompts, which
    `bigtrain generate` asks them as too."""

    def __init__(self, tokenizer: Any, fmt: str):
        assert fmt in EXAMPLE_FORMATS, fmt
        self.tok, self.fmt = tokenizer, fmt
        self.plain_examples = 0
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no end-of-text token to end an answer with; "
                             "use a tokenizer that has one")
        self.eos = int(eos)
        self.start = _start_tokens(tokenizer)
        self.template = getattr(tokenizer, "chat_template", None)
        if fmt in TEMPLATED and not self.template:
            raise ValueError(no_template_line(tokenizer))
        self.tagged = has_generation_tags(self.template)
        # what ends an answer: trained too where a {% generation %} block stops short of it
        self.turn_ends = {self.eos, *turn_end_ids(tokenizer)} if self.tagged else set()

    def examples(self, record: dict) -> list[tuple[list[int], list[int]]]:
        """The record's examples: one, or for a preference pair two (the chosen answer's, then the rejected's)."""
        if not getattr(self, "keeps_images", False) and any(record.get(c) not in (None, []) for c in ("images", "image")):
            raise ValueError(TEXT_MODEL_IMAGES)
        if self.fmt in PAIR_FORMATS:
            chosen, rejected = record.get("chosen"), record.get("rejected")
            if {type(chosen), type(rejected)} == {str, list}:  # one side through the template, one as plain text
                raise ValueError(f"a preference record's 'chosen' is a {type(chosen).__name__} and its 'rejected' a "
                                 f"{type(rejected).__name__}: give both as strings or both as message lists, so that "
                                 "both answers follow the same prompt")
            return [self.answer(record, "chosen"), self.answer(record, "rejected")]
        if self.fmt in UNPAIRED_FORMATS:
            label = record.get("label")
            if not isinstance(label, bool):
                raise ValueError(f"a kto record's 'label' is {label!r}: give true (a desirable answer) or false")
            ids, mask = self.answer({"prompt": record.get("prompt"), "completion": record.get("completion")},
                                    "completion")
            return [(ids, mask if label else [UNDESIRABLE * m for m in mask])]
        return [self(record)]

    def answer(self, record: dict, which: str) -> tuple[list[int], list[int]]:
        """One side of a preference pair: the prompt and that answer, the answer's tokens trained."""
        if self.fmt == "preference_instruction":
            return self._plain(_alpaca_prompt(record), _text(record, which))
        answer, prompt = record.get(which), record.get("prompt")
        if isinstance(answer, str):
            if not isinstance(prompt, str):
                raise ValueError(f"a preference record with a text {which!r} answer needs a text 'prompt' (it has "
                                 f"{type(prompt).__name__}); give conversations as message lists to let the shared "
                                 "turns be the prompt")
            return self._plain(prompt, answer)
        if not isinstance(answer, list):
            raise ValueError(f"a preference record's {which!r} is {type(answer).__name__}: give a string, or a list "
                             "of messages")
        if prompt is None and which == "completion":
            raise ValueError("a kto record needs a 'prompt' (a string or a list of messages)")
        if prompt is None:  # TRL's implicit prompt: the turns both conversations share
            head = _shared_turns(record.get("chosen"), record.get("rejected"))
            answer = answer[len(head):]
        else:
            head = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not answer:
            raise ValueError(f"a preference record's {which!r} conversation has no turn after the prompt (chosen and "
                             "rejected are the same turns): there is no answer to compare")
        if not self.template:
            raise ValueError(no_template_line(self.tok, f"{self.fmt} records of messages"))
        return self.conversation_answer(self.messages(head) if head else [], self.messages(answer))

    def conversation_answer(self, prompt: list[dict], answer: list[dict]) -> tuple[list[int], list[int]]:
        """A conversation whose trained tokens are the answer's assistant turns only, not the prompt's."""
        asked = self._apply(prompt, add_generation_prompt=True) if prompt else ""  # the prompt as the model sees it
        if self.tagged:
            ids, mask = self.chat(prompt + answer)
            cut = len(self._encode(asked))
            return ids, [0] * cut + mask[cut:]
        text, spans = self.render(prompt + answer)
        if not text.startswith(asked):
            raise ValueError("the chat template renders the prompt differently once an answer follows, so the answer "
                             "cannot be told from the prompt; give data.chat_template a template that renders each "
                             "turn alike")
        return self.encode_spans(text, [(max(start, len(asked)), end) for start, end in spans if end > len(asked)])

    def __call__(self, record: dict) -> tuple[list[int], list[int]]:
        if self.fmt == "chat":
            return self.chat(record["messages"], record_tools(record))
        if self.fmt == "sharegpt":
            return self.chat(sharegpt_messages(record["conversations"]))
        if self.fmt == "prompt_completion":
            return self._plain(_text(record, "prompt"), _text(record, "completion"))
        return self._plain(_alpaca_prompt(record), _text(record, "output"))

    def _plain(self, prompt: str, completion: str) -> tuple[list[int], list[int]]:
        """A plain-text prompt and its completion, the completion (and the end-of-text after it) trained."""
        # Tokenized apart, so the prompt's tokens are the ones a prompt fed alone at inference gets (TRL warns
        # when the two differ; a byte-level BPE cuts at the space that starts a completion anyway).
        head = self.start + self._encode(prompt)
        tail = self._encode(completion) + [self.eos]
        self.plain_examples += 1
        return head + tail, [0] * len(head) + [1] * len(tail)

    def chat(self, messages: Any, tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
        """A conversation, its assistant turns trained (a tool-use conversation's calls too, its results not);
        `tools`: the JSON schemas the template shows (a record's 'tools', TRL's column)."""
        messages = self.messages(messages)
        if self.tagged:  # the template marks the assistant's text itself
            out = self._apply(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                              tools=tools)
            ids = list(out["input_ids"])
            return ids, self._with_turn_ends(ids, [int(m) for m in out["assistant_masks"]])
        return self.encode_spans(*self.render(messages, tools))

    def messages(self, messages: Any) -> list[dict]:
        """A conversation's messages, checked (`chat_messages`)."""
        return chat_messages(messages)

    def encode_spans(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        """The tokens of a rendered text and the mask of those overlapping the character `spans`."""
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), _overlap_mask(enc["offset_mapping"], spans)

    def _with_turn_ends(self, ids: list[int], mask: list[int]) -> list[int]:
        """The end-of-turn token right after each trained span trained too: a {% generation %} block around the
        answer's text alone leaves it out, and a model trained so never learns to stop."""
        for i in range(1, len(ids)):
            if mask[i - 1] and not mask[i] and ids[i] in self.turn_ends:
                mask[i] = 1
        return mask

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the character span of each assistant turn in it.

        A turn's span is what rendering the conversation up to and including it adds to rendering the
        conversation before it with the generation prompt (`add_generation_prompt=True`: what the model sees
        when asked to answer): the answer and its end-of-turn marker. This holds for templates that render
        each turn the same whatever follows it; one that does not (e.g. dropping earlier reasoning) is refused.
        """
        text = self._apply(messages, tools=tools)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._apply(messages[:i], add_generation_prompt=True, tools=tools) if i else ""
            upto = self._apply(messages[:i + 1], tools=tools)
            if not (upto.startswith(before) and text.startswith(upto)):
                raise ValueError("the chat template renders an earlier turn differently once later turns follow, so "
                                 "the assistant's tokens cannot be found from it; give data.chat_template a template "
                                 "that marks them with {% generation %} ... {% endgeneration %}")
            spans.append((len(before), len(upto)))
        return text, spans

    def _apply(self, messages: list[dict], **kwargs: Any) -> Any:
        from jinja2 import TemplateError
        try:
            return self.tok.apply_chat_template(messages, tokenize=kwargs.pop("tokenize", False), **kwargs)
        except TemplateError as e:  # the template's own raise_exception: roles out of order, say
            raise ValueError(f"the chat template refused a conversation: {e}") from None

    def _encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"]) if text else []


def record_tools(record: dict) -> list[dict] | None:
    """A chat record's 'tools' (TRL's column: the JSON schemas of the functions its conversation may call, a list
    or its JSON text), for the template to show; None without."""
    tools = record.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            raise ValueError("a chat record's 'tools' is text that is not JSON: give the functions' JSON schemas "
                             "as a list (or its JSON text)") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"a chat record's 'tools' is {type(tools).__name__}: give the functions' JSON schemas as a "
                         "list ([{\"type\": \"function\", \"function\": {...}}])")
    return tools or None


def chat_messages(messages: Any) -> list[dict]:
    """A record's messages, checked: known roles and text content (OpenAI-style text parts joined), so that what a
    template would render as a Python repr or an empty answer is one line instead of silent training data."""
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ValueError("a chat record's 'messages' must be a non-empty list of {\"role\": ..., \"content\": ...}")
    checked = []
    for message in messages:
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise ValueError(f"a chat message has role {role!r}: bigtrain trains on {', '.join(CHAT_ROLES)} "
                             "(ShareGPT's from/value turns: data.format=sharegpt)")
        if isinstance(content, list):
            kinds = {part.get("type") if isinstance(part, dict) else type(part).__name__ for part in content}
            if "image" in kinds:
                raise ValueError(TEXT_MODEL_IMAGES)
            if kinds - {"text"}:
                raise ValueError(f"a chat message's content has {sorted(map(str, kinds - {'text'}))} parts: bigtrain "
                                 "trains on text; give text parts or a string")
            content = "".join(part.get("text") or "" for part in content)
        if content is None and message.get("tool_calls"):
            checked.append(message)  # an assistant's tool call: the template renders it
            continue
        if not isinstance(content, str):
            raise ValueError(f"a chat message of role {role!r} has content of type {type(content).__name__}, not text")
        checked.append({**message, "content": content})
    return checked


def sharegpt_messages(turns: Any) -> list[dict]:
    """A ShareGPT conversation as chat messages: "from" -> role, "value" -> content."""
    if not isinstance(turns, list) or not turns or not all(isinstance(t, dict) for t in turns):
        raise ValueError("a sharegpt record's 'conversations' must be a non-empty list of {\"from\": ..., "
                         "\"value\": ...}")
    messages = []
    for turn in turns:
        speaker = turn.get("from")
        if speaker not in SHAREGPT_ROLES:
            raise ValueError(f"a sharegpt turn is from {speaker!r}: bigtrain knows {', '.join(SHAREGPT_ROLES)}; "
                             "convert the records to 'messages' with roles to train on other speakers")
        messages.append({"role": SHAREGPT_ROLES[speaker], "content": turn.get("value")})
    return messages


def check_template(formats: list[str], tokenizer: Any) -> None:
    """ValueError (one line) when `formats` hold conversations and the tokenizer (None: one still to be trained,
    which has none) has no chat template to render them with."""
    found = [f for f in formats if f in TEMPLATED]
    if found and not getattr(tokenizer, "chat_template", None):
        raise ValueError(no_template_line(tokenizer, f"data.format={found[0]}"))


def no_template_line(tokenizer: Any, what: str = "data.format=chat") -> str:
    """`what` needs conversations rendered, and the tokenizer has no chat template (GPT-2's has none)."""
    return (f"{what}: the tokenizer {str(getattr(tokenizer, 'name_or_path', '')) or '(trained here)'!r} "
            "has no chat template to render conversations with; give one with data.chat_template=FILE (prepare "
            "--chat-template FILE: a Jinja file, or the template text), or use a tokenizer that has one")


def _text(record: dict, field: str) -> str:
    value = record.get(field)
    if not isinstance(value, str):
        raise ValueError(f"a record's {field!r} is {type(value).__name__}, not text (give prompt/completion pairs as "
                         "strings; conversations as one 'messages' list)")
    return value


def _alpaca_prompt(record: dict) -> str:
    """Stanford Alpaca's prompt for an instruction (and input) record."""
    instruction, extra = _text(record, "instruction"), record.get("input") or ""
    if not isinstance(extra, str):
        raise ValueError(f"an instruction record's 'input' is {type(extra).__name__}, not text")
    template = ALPACA_PROMPT if extra.strip() else ALPACA_PROMPT_NO_INPUT
    return template.format(instruction=instruction, input=extra)


def _shared_turns(chosen: Any, rejected: Any) -> list:
    """The messages two conversations share from their start (TRL's implicit prompt)."""
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise ValueError("a preference record without a 'prompt' needs 'chosen' and 'rejected' as message lists "
                         "(their shared turns are the prompt)")
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    return chosen[:shared]


def _start_tokens(tokenizer: Any) -> list[int]:
    """What the tokenizer puts before a text by default (a Llama BOS; nothing for GPT-2's BPE), found on a probe
    text it can encode: "a", else one of its own words (a word-level vocabulary without an unknown token cannot
    encode "a")."""
    for probe in itertools.chain(["a"], itertools.islice(_own_words(tokenizer), 3)):
        try:
            bare = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
            full = list(tokenizer(probe)["input_ids"])
        except Exception:  # noqa: BLE001 -- the tokenizers library's own error for a text it cannot encode
            continue
        cut = len(full) - len(bare)
        return full[:cut] if cut > 0 and full[cut:] == bare else []
    return []


def _own_words(tokenizer: Any) -> Iterator[str]:
    """The vocabulary's words that are not special tokens, read only when asked for (a generator)."""
    special = set(getattr(tokenizer, "all_special_tokens", []) or [])
    yield from (word for word in tokenizer.get_vocab() if word not in special)


def _overlap_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for every token whose characters overlap a span (as transformers' assistant mask), else 0."""
    mask = [0] * len(offsets)
    k = 0
    for i, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0] and end > start:
            mask[i] = 1
    return mask


def turn_end_ids(tokenizer: Any) -> list[int]:
    """The special token a chat template closes an assistant's turn with (Llama 3's <|eot_id|>, Qwen's <|im_end|>),
    found by rendering one turn: generation stops there too, whatever the model's eos (`bigtrain generate`, the
    end-of-run sample, an export's generation_config)."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": "A7"}],
                                             tokenize=False)
    except Exception:  # noqa: BLE001 -- a template that needs other roles or fields: no extra stop
        return []
    after = text.rsplit("A7", 1)[-1]
    try:
        ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    except Exception:  # noqa: BLE001 -- a vocabulary that cannot encode the probe's text: no extra stop
        return []
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return [ids[0]] if ids and ids[0] in special else []
