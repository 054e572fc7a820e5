"""How a model writes its tool calls, and how its chat template shows their results.

    fmt = ToolFormat(tokenizer, stops)          # the tokenizer's response_template, else its template's family
    message, calls = fmt.parse(turn_ids, prefix_ids, schemas)
    ids = fmt.suffix(tool_messages)             # the template's tokens after the model's turn: the results and the
                                                # next assistant header
    problem = template_problem(tokenizer)       # None, or why its template cannot do tools and what would

Parsing: a tokenizer with a `response_template` (transformers' response parsing) is read by its own
`parse_response`, with the prompt as its prefix and the tools' schemas typing the arguments; others by the format
of the family their chat template belongs to:

    hermes    Qwen 2 / 2.5 / 3, Hermes, and every template that writes <tool_call>{"name": ..., "arguments": ...}
              </tool_call> (several calls a turn)
    llama3    Llama 3.1 / 3.2: the whole turn one JSON object {"name": ..., "parameters": ...}, after <|python_tag|>
              or alone
    mistral   [TOOL_CALLS][{"name": ..., "arguments": ...}, ...], or [TOOL_CALLS]name[ARGS]{...} (newer templates)

A call whose JSON does not parse is kept, with its error, which becomes the tool's answer (a failure), so that the
model is told; a turn with no call ends the rollout.

The suffix is the difference of two renders (TRL's `_get_tool_suffix_ids`): a short conversation ending with an
assistant's call, without and with the tool messages (and the generation prompt); the first is cut after its last
stop token, where the model's own turn ended. So the model's tokens are never re-tokenized, and what follows them is
exactly what the template puts there. A template whose earlier messages render otherwise once a result follows
cannot be cut so: `template_problem` says so before any rank starts.
"""
from __future__ import annotations

import json
import re
from typing import Any

from bigtrain.rollout.tools import Call

TOOL_TEMPLATE_HINT = ("give data.chat_template a template that renders them, e.g. Qwen2.5's (in TRL: "
                      "trl/chat_templates/qwen2_5.jinja), and teach the model its call format first (fine-tuning on "
                      "tool-use conversations: docs/online-rl.md)")
# sentinels of the probe conversation (TRL's supports_tool_calling): each must survive the render
_NAME, _KEY, _VALUE, _ANSWER = "tool_name_a8f3", "tool_arg_key_b9d4", "tool_arg_val_d6e7", "tool_answer_c4f9"
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_MISTRAL_NAMED = re.compile(r"([A-Za-z_][\w.\-]*)\[ARGS\]")


def family(tokenizer: Any) -> str | None:
    """How the tokenizer's calls are read: response_template, hermes, llama3, mistral; None when bigtrain knows
    none."""
    if getattr(tokenizer, "response_template", None) is not None:
        return "response_template"
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default") or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("ipython" in template and "parameters" in template):
        return "llama3"
    return None


class ToolFormat:
    """A tokenizer's way of writing calls and showing results; `stops`: the ids a turn of the model ends with."""

    def __init__(self, tokenizer: Any, stops: list[int]):
        self.tok, self.stops = tokenizer, list(stops)
        self.family = family(tokenizer)
        assert self.family is not None, "template_problem() refuses such a tokenizer before any rank starts"

    def parse(self, ids: list[int], prefix: list[int], schemas: list[dict]) -> tuple[dict, list[Call]]:
        """A turn's tokens (its stop token included or not) -> (the assistant message, its calls)."""
        body = list(ids)
        while body and body[-1] in self.stops:
            body.pop()
        if self.family == "response_template":
            return self._parsed(ids, prefix, schemas)
        text = self.tok.decode(body, skip_special_tokens=False)
        content, calls = {"hermes": _hermes, "llama3": _llama3, "mistral": _mistral}[self.family](text)
        if any(c.error is not None for c in calls):  # a call that does not parse is shown as the model wrote it
            return assistant_message(text.strip(), []), calls
        return assistant_message(content, calls), calls

    def _parsed(self, ids: list[int], prefix: list[int], schemas: list[dict]) -> tuple[dict, list[Call]]:
        try:
            message = self.tok.parse_response(ids, prefix=prefix, tools=schemas or None)
        except Exception:  # noqa: BLE001 -- a turn it cannot read (cut short, broken) is plain text, as in TRL
            message = None
        if not isinstance(message, dict):
            return assistant_message(self.tok.decode(ids, skip_special_tokens=True), []), []
        calls = []
        for call in message.get("tool_calls") or []:
            function = call.get("function", call) if isinstance(call, dict) else {}
            name = function.get("name") if isinstance(function, dict) else None
            arguments = function.get("arguments", {}) if isinstance(function, dict) else None
            if isinstance(arguments, str):
                arguments = _json_or_error(arguments)
            calls.append(_call(name, arguments))
        return assistant_message(message.get("content") or "", calls), calls

    def suffix(self, tool_messages: list[dict]) -> list[int]:
        """The template's tokens after a turn that called tools: their results, then the next assistant header."""
        dummy = [{"role": "user", "content": "dummy"},
                 {"role": "assistant", "content": "", "tool_calls": [_call_entry(tool_messages[0]["name"], {})]}]
        prefix = self._render(dummy, False)
        full = self._render(dummy + tool_messages, True)
        ends = [i for i, token in enumerate(prefix) if token in self.stops]
        if ends:  # the model's turn ends at its stop token; what the template adds after it is the suffix's
            prefix = prefix[:ends[-1] + 1]
        if full[:len(prefix)] != prefix:
            raise ValueError("the chat template renders an assistant's tool call differently once its result "
                             f"follows, so the result's tokens cannot be cut from it; {TOOL_TEMPLATE_HINT}")
        return full[len(prefix):]

    def _render(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        out = self.tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                           return_dict=False)
        return list(out["input_ids"] if isinstance(out, dict) else out)


def assistant_message(content: str, calls: list[Call]) -> dict:
    """The assistant's turn as a message (TRL's form: tool_calls entries of type function)."""
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [_call_entry(c.name, c.arguments if isinstance(c.arguments, dict) else {})
                                 for c in calls]
    return message


def template_problem(tokenizer: Any) -> str | None:
    """Why the tokenizer's chat template cannot carry tool calls (None if it can): no template, a template that
    drops the call or the result or raises on them, earlier turns rendered otherwise once a result follows, or a
    format bigtrain cannot read."""
    if not getattr(tokenizer, "chat_template", None):
        return f"the tokenizer has no chat template, so the model cannot be shown tools or their results; " \
               f"{TOOL_TEMPLATE_HINT}"
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [_call_entry(_NAME, {_KEY: _VALUE})]},
                {"role": "tool", "name": _NAME, "content": _ANSWER}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as e:  # noqa: BLE001 -- Jinja's TemplateError, a template indexing what is not there
        return f"the chat template raises on a tool call and its result ({type(e).__name__}: " \
               f"{str(e).splitlines()[0] if str(e) else ''}); {TOOL_TEMPLATE_HINT}"
    dropped = [what for what, sentinels in (("the call", (_NAME, _KEY, _VALUE)), ("the result", (_ANSWER,)))
               if not all(s in text for s in sentinels)]
    if dropped:
        return f"the chat template drops {' and '.join(dropped)} of a tool call (the model would never see it); " \
               f"{TOOL_TEMPLATE_HINT}"
    if family(tokenizer) is None:
        return ("bigtrain cannot read the calls this template's model writes: the tokenizer has no response_template "
                "and the template is none of Qwen/Hermes (<tool_call>), Llama 3.1 (JSON) or Mistral ([TOOL_CALLS]); "
                f"set the tokenizer's response_template, or {TOOL_TEMPLATE_HINT}")
    stops = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    try:
        ToolFormat(tokenizer, stops).suffix([{"role": "tool", "name": _NAME, "content": _ANSWER}])
    except ValueError as e:
        return str(e)
    return None


def _call_entry(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _call(name: Any, arguments: Any) -> Call:
    if not isinstance(name, str) or not name:
        return Call("unknown", None, "the tool call has no name: write {\"name\": ..., \"arguments\": {...}}")
    if isinstance(arguments, Call):  # the arguments' JSON did not parse
        return Call(name, None, arguments.error)
    return Call(name, {} if arguments is None else arguments)


def _json_or_error(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        return Call("unknown", None, f"the tool call is not valid JSON: {text.strip()[:100]}")


def _from_object(value: Any) -> Call:
    """A parsed {"name": ..., "arguments" | "parameters": ...} (or the error of its JSON) as a call."""
    if isinstance(value, Call):
        return value
    if not isinstance(value, dict):
        return Call("unknown", None, "a tool call is a JSON object {\"name\": ..., \"arguments\": {...}}")
    arguments = value.get("arguments", value.get("parameters"))
    if isinstance(arguments, str):
        arguments = _json_or_error(arguments)
    return _call(value.get("name"), arguments)


def _hermes(text: str) -> tuple[str, list[Call]]:
    found = list(_HERMES.finditer(text))
    content = text[:found[0].start()].strip() if found else text.strip()
    return content, [_from_object(_json_or_error(m.group(1).strip())) for m in found]


def _llama3(text: str) -> tuple[str, list[Call]]:
    body = text.strip()
    body = body.removeprefix("<|python_tag|>").strip()
    if not body.startswith("{") or '"name"' not in body:
        return text.strip(), []
    parts = [p for p in (body.split("; ") if "}; {" in body else [body]) if p.strip()]
    return "", [_from_object(_json_or_error(p)) for p in parts]


def _mistral(text: str) -> tuple[str, list[Call]]:
    head, sep, rest = text.partition("[TOOL_CALLS]")
    if not sep:
        return text.strip(), []
    rest = rest.strip()
    if rest.startswith("["):  # [{"name": ..., "arguments": ...}, ...]
        parsed = _json_or_error(rest)
        items = parsed if isinstance(parsed, list) else [parsed]
        return head.strip(), [_from_object(item) for item in items]
    calls = []  # name[ARGS]{...}name[ARGS]{...}
    marks = list(_MISTRAL_NAMED.finditer(rest))
    for i, mark in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(rest)
        calls.append(_call(mark.group(1), _json_or_error(rest[mark.end():end].strip())))
    if not marks:
        calls.append(Call("unknown", None, f"a call after [TOOL_CALLS] is not readable: {rest[:200]}"))
    return head.strip(), calls
