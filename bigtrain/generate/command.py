"""`bigtrain generate` and `bigtrain chat` in one process, which is one rank of several when a launcher started it
for --zero3 (`python -m bigtrain.generate`). The model is loaded as `bigtrain eval` loads it (`bigtrain.eval.target`,
`bigtrain.eval.partitioned.held_target`): a run folder consolidated in memory, an export, an adapter on its base, a
Hub name; with --zero3 rank 0 consolidates it and every rank holds 1/N of each weight, and every rank runs every
forward pass (transformers' synced_gpus). Rank 0 reads the terminal and prints; the others wait for its lines
through the process group's store, as long as a person takes to type (no collective timeout).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from bigtrain.atomic import write_atomic
from bigtrain.distributed.world import World
from bigtrain.generate.prompts import read_prompts, shown
from bigtrain.data.chat import turn_end_ids
from bigtrain.data.formats import PLAIN_TEXT
from bigtrain.generate.sampling import generate, prompt_ids, sampling_from_args, uses_template

CHAT_HELP = "/reset clears the conversation, /system TEXT sets a system message, /exit or Ctrl-D ends"


class Session:
    """A loaded model and how it is asked: the template, the generation settings, the stops."""

    def __init__(self, args: argparse.Namespace, world: World) -> None:
        from bigtrain.eval.partitioned import held_target
        self.world, self.sampling = world, sampling_from_args(args)
        self.target = held_target(args.target, args.tag, args.tokenizer, args.trust_checkpoint, args.revision, world,
                                  args.zero3)
        self.model, self.tokenizer = self.target.model.eval(), self.target.tokenizer
        self.images = opened_images(args.image, self.target.processor, self.target.description)
        trained_on_text = self.target.prompts == PLAIN_TEXT  # asked as the run asked its training prompts
        self.template = uses_template(self.tokenizer, args.raw or trained_on_text)
        stops = turn_end_ids(self.tokenizer) if self.template else []
        self.config = self.sampling.generation_config(self.model, self.tokenizer, stops)
        self.synced = args.zero3 and world.size > 1
        self.tooling = None
        if args.tools or args.environment:  # the functions and environment the model was trained to call
            from bigtrain.generate.tool_use import Tooling
            if not self.template:
                raise ValueError("--tools / --environment: the model is shown its tools by its chat template, and "
                                 "prompts go as plain text here (--raw, a model trained on plain-text records, or "
                                 "a tokenizer without a template)")
            if self.images:
                raise ValueError("--tools / --environment with --image: calling tools is for text models here; "
                                 "drop --image or the tools")
            self.tooling = Tooling(args, self.tokenizer, stops)
        if world.is_main:
            say(f"{self.target.description}; prompts as {self.prompts_as(args.raw)}; {_settings_line(self.config)}")

    def prompts_as(self, raw: bool) -> str:
        """How the prompts reach the model, and why, for the start line."""
        if self.template:
            return "its chat template"
        if raw:
            return "plain text (--raw)"
        if self.target.prompts == PLAIN_TEXT and uses_template(self.tokenizer, False):
            return ("plain text, as its training data asked them (plain-text records, not conversations: the "
                    "tokenizer's chat template is left out)")
        return "plain text (the tokenizer has no chat template)"

    def answer(self, conversation: list[dict] | str, streamer: Any = None) -> tuple[str, list[dict]]:
        """The answer's text, and the messages it adds to the conversation (with tools: the calls and their
        results before it)."""
        if self.tooling is None:
            extra: dict = {}
            if self.images:  # a vision-language model: the images before the first question, through the processor
                ids, extra = image_prompt(self.target.processor, conversation, self.images, self.template)
            else:
                ids = prompt_ids(self.tokenizer, conversation, self.template)
            new = generate(self.model, self.tokenizer, ids, self.sampling, self.config, self.synced, streamer, extra)
            text = self.tokenizer.decode(new, skip_special_tokens=True)
            return text, [{"role": "assistant", "content": text}]

        def turn(messages: list[dict]) -> tuple[list[int], list[int]]:
            ids = prompt_ids(self.tokenizer, messages, True, self.tooling.schemas)
            return ids, generate(self.model, self.tokenizer, ids, self.sampling, self.config, self.synced, streamer)

        added = self.tooling.answer(list(conversation), turn, say if self.world.is_main else _quiet, self.world)
        return added[-1].get("content") or "", added


def opened_images(paths: list[str], processor: Any, model: str) -> list[Any]:
    """--image files, opened; one line for an image that does not open, or images given to a text model."""
    if not paths:
        return []
    if processor is None:
        raise ValueError(f"--image: {model} reads text only (no vision-language model, no processor); give the "
                         "directory or run of a vision-language model (--model vlm), or drop --image")
    from bigtrain.data.vision import open_image
    opened = []
    for path in paths:
        try:
            opened.append(open_image(path, None)[0])
        except ValueError as err:
            raise ValueError(f"--image {path}: {err}") from None
    return opened


def image_prompt(processor: Any, conversation: list[dict] | str, images: list[Any],
                 template: bool) -> tuple[list[int], dict]:
    """The prompt's ids with the images' placeholders expanded, and the processor's image inputs: the images go
    before the first user turn's text (TRL's rule for a conversation of strings); without the template, their
    placeholders before the text."""
    from bigtrain.data.vision import place_images
    if template:
        messages = [{"role": "user", "content": conversation}] if isinstance(conversation, str) else conversation
        placed, _, _ = place_images(messages, images)
        text = processor.apply_chat_template(placed, add_generation_prompt=True, tokenize=False)
    else:
        text = processor.image_token * len(images) + conversation
    batch = processor(text=[text], images=[images], return_tensors="pt")
    ids = batch.pop("input_ids")[0].tolist()
    batch.pop("attention_mask", None)
    return ids, {k: v for k, v in batch.items() if k in processor.model_input_names}


def run_generate(args: argparse.Namespace, world: World) -> int:
    """Each prompt's completion on stdout (rank 0), and in --out as JSON lines."""
    prompts = read_prompts(args.prompt, args.prompts_file)  # before loading: a wrong file costs nothing
    session = Session(args, world)
    records = []
    for number, prompt in enumerate(prompts, start=1):
        conversation = with_system(prompt, args.system) if session.template else prompt
        if session.tooling is not None:
            session.tooling.reset()
        completion, added = session.answer(conversation)
        records.append({"prompt": prompt, "completion": completion,
                        **({"messages": added} if session.tooling is not None else {})})
        if world.is_main:
            if len(prompts) > 1:
                print(f"=== {number}/{len(prompts)}: {shown(prompt)}", flush=True)
            print(completion, flush=True)
    if args.out and world.is_main:
        out = Path(args.out).expanduser()
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        say(f"wrote {len(records)} completions to {out}")
    return 0


def run_chat(args: argparse.Namespace, world: World) -> int:
    """A conversation in the terminal: history kept and rendered by the chat template each turn, the answer
    streamed as it is generated. Ends at /exit, Ctrl-D (end of input) or Ctrl-C while typing; Ctrl-C while it
    answers stops that answer."""
    session = Session(args, world)
    system, history = args.system, []
    if world.is_main:
        say(CHAT_HELP)
        if sys.stdin.isatty():
            import readline  # noqa: F401 -- input() then edits the line and recalls earlier ones
    while (line := next_line(world)) is not None:
        command, _, rest = line.strip().partition(" ")
        if command in ("/exit", "/quit"):
            break
        if command in ("/reset", "/system"):
            history = []
            if session.tooling is not None:
                session.tooling.reset()
            system = (rest.strip() or None) if command == "/system" else system
            if world.is_main:
                say("(a new conversation" + (f", system: {system})" if system else ")"))
            continue
        if command == "/help" or not line.strip():
            if world.is_main and command == "/help":
                say(CHAT_HELP)
            continue
        history.append({"role": "user", "content": line})
        conversation = with_system(history, system) if session.template else transcript(history)
        streamer = _streamer(session.tokenizer) if world.is_main else None
        try:
            _, added = session.answer(conversation, streamer)  # the streamer ends each turn's line
        except KeyboardInterrupt:  # Ctrl-C stops this answer, not the chat (one process; ranks all get the signal)
            if world.size > 1:
                raise
            history.pop()
            say("\n(stopped; that question is not kept)")
            continue
        history += added
    return 0


def next_line(world: World) -> str | None:
    """The next line typed on rank 0 (None at the end), on every rank."""
    def read() -> str:
        try:
            return json.dumps({"line": input(">>> " if sys.stdin.isatty() else "")})
        except (EOFError, KeyboardInterrupt):
            return json.dumps({"end": True})

    if world.size == 1:
        answer = read()
    else:
        from bigtrain.distributed.patient import from_rank0
        answer = from_rank0(read if world.is_main else None)
    found = json.loads(answer)
    if found.get("end") and world.is_main and sys.stdin.isatty():
        print(flush=True)  # the ">>> " line Ctrl-D left open
    return None if found.get("end") else found["line"]


def with_system(prompt: list[dict] | str, system: str | None) -> list[dict]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}, *messages]
    return messages


def transcript(history: list[dict]) -> str:
    """A model without a chat template continues the conversation as plain text, one turn a line."""
    return "\n".join(m["content"] for m in history) + "\n"


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _quiet(line: str) -> None:
    """What a rank other than 0 says: nothing."""


def _streamer(tokenizer: Any) -> Any:
    from transformers import TextStreamer
    return TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


def _settings_line(config: Any) -> str:
    if config.num_beams and config.num_beams > 1:
        how = f"beam search ({config.num_beams} beams)"
    elif config.do_sample:
        parts = [f"{k} {getattr(config, k)}" for k in ("temperature", "top_p", "top_k", "min_p")
                 if getattr(config, k, None) is not None]
        how = "sampling" + (f" ({', '.join(parts)})" if parts else "")
    else:
        how = "greedy decoding"
    return f"{how}, up to {config.max_new_tokens} new tokens"


def rank_main(argv: list[str] | None = None) -> int:
    """The entry of each launched rank: the process group (or a world of one), the verb, an orderly end."""
    from bigtrain.generate.flags import build_rank_parser
    from bigtrain.metrics.logs import quiet_hf_progress_bars, route_library_logs
    args = build_rank_parser().parse_args(argv)
    route_library_logs(verbose=args.verbose, console=sys.stderr)
    quiet_hf_progress_bars()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from bigtrain.distributed.world import init_distributed, shutdown
        world = init_distributed()
    else:
        world, shutdown = World(0, 0, 1), None
    try:
        code = (run_chat if args.mode == "chat" else run_generate)(args, world)
    except ValueError as err:  # every rank meets the same mistake; rank 0 says it
        if world.is_main:
            print(f"bigtrain {args.mode}: {err}", file=sys.stderr, flush=True)
        return 2
    if shutdown is not None:
        shutdown()
    return code
