"""A task for agentic RL that cannot be solved without a tool: the code in a numbered box.

    prompt "ticket 17: open box 3"  ->  call open_box(box=3)  ->  the vault answers "7"  ->  answer "7"

The codes are the environment's (`Vault`, in a file written by `write_vault`), each record's own (its `code`
column, which reset gets and no prompt shows): no model can know them without opening the box. A tokenizer
made here (a byte-level BPE trained on the task's own renders, Qwen's <|im_start|> / <|im_end|> as special tokens,
the end-of-text <|im_end|> apart from the pad) with Qwen 2.5's chat template as TRL ships it
(trl/chat_templates/qwen2_5.jinja, which renders tools and writes calls as <tool_call>{json}</tool_call>), and a
tiny Llama for its vocabulary. Used by tests/unit/test_agentic.py and tests/dist/test_agentic_rl.py; the task of a run
that learns (LEARNING_VAULT, learning_records, learning_demonstrations) by tests/dist/test_agentic_learning.py.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

CODES = [7, 2, 9, 4, 0, 5, 8, 1, 6, 3]  # the code of box b where a record gives none (a chat)
SPECIALS = ["<|im_start|>", "<|im_end|>"]
VAULT = '''"""The vault: boxes whose codes only it knows (tests/tool_task.py)."""
CODES = {codes!r}


class Vault:
    def reset(self, box=0, code=None, **record):
        self.box, self.opened = int(box), []
        self.code = CODES[self.box] if code is None else int(code)  # the record's own: in no prompt

    def open_box(self, box: int) -> str:
        """Open a box and read the code inside.

        Args:
            box: the number of the box to open
        """
        box = int(box)
        if not 0 <= box < len(CODES):
            raise ValueError(f"there is no box {{box}}")
        self.opened.append(box)
        return str(self.code if box == self.box else CODES[box])

    def get_reward(self) -> float:
        """0.5 for opening the box the prompt names."""
        return 0.5 if self.box in self.opened else 0.0


def correct(completions, environments, **kwargs):
    """1.0 when the last answer is the code in the prompt's box."""
    return [float(c[-1].get("content", "").strip() == str(e.code)) for c, e in zip(completions, environments)]
'''


# A compact ChatML template that renders tools and calls in a few tokens (Qwen's system prompt alone is ~200 of this
# BPE's tokens), for the runs that train: its calls are read by the tokenizer's own response_template (transformers'
# parse_response), as TRL 1.16's for Qwen 3 reads them, so TRL's GRPOTrainer takes it too.
COMPACT = (
    "{%- if tools %}{{- '<|im_start|>system\\ntools:' }}{%- for tool in tools %}{{- ' ' + tool.function.name + '(' + "
    "(tool.function.parameters.properties | list | join(', ')) + ')' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}{%- set call = call.function if call.function is defined else call %}"
    "{{- '<tool_call>{\"name\": \"' + call.name + '\", \"arguments\": ' + (call.arguments | tojson) + '}</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
RESPONSE = {"defaults": {"role": "assistant"}, "start_anchor": "<|im_start|>assistant\n", "fields": {
    "tool_calls": {"open": "<tool_call>", "close_pattern": "</tool_call>\\s*", "repeats": True, "content": "json",
                   "transform": {"type": "function", "function": "{content}"}},
    "content": {"close_pattern": "<\\|im_end\\|>\\s*", "content": "text"}}}


def template() -> str:
    import trl
    return (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()


def prompt(box: int, ticket: int) -> list[dict]:
    return [{"role": "user", "content": f"ticket {ticket}: open box {box}"}]  # the box last: a tiny model copies it


def records(n: int, seed: int = 0) -> list[dict]:
    """{"prompt", "box", "code"} records, boxes and codes drawn from `seed`; each prompt unique (its ticket)."""
    rng = random.Random(seed)
    drawn = [(rng.randrange(10), rng.randrange(10)) for _ in range(n)]
    return [{"prompt": prompt(box, i), "box": box, "code": code} for i, (box, code) in enumerate(drawn)]


def call_text(box: Any, name: str = "open_box") -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{"box": {json.dumps(box)}}}}}\n</tool_call>'


def demonstrations(n: int, seed: int = 0) -> list[dict]:
    """Chat records of the whole exchange (the call, the vault's answer, the code), for fine-tuning the format."""
    out = []
    for r in records(n, seed):
        call = {"type": "function", "function": {"name": "open_box", "arguments": {"box": r["box"]}}}
        out.append({"messages": [*r["prompt"], {"role": "assistant", "content": "", "tool_calls": [call]},
                                 {"role": "tool", "name": "open_box", "content": str(r["code"])},
                                 {"role": "assistant", "content": str(r["code"])}],
                    "tools": [SCHEMA]})
    return out


# The vault of a run that learns (tests/dist/test_agentic_learning.py). Its answers and the model's are shaped for a
# tiny model to copy: the code comes as a token of its own (" 7", not fused with what precedes it) and the model
# answers "code 7", so that the token that must copy it is one no other turn has (after a bare "assistant\n" the
# model also starts its calls; a 2-layer model fine-tuned to answer there learned the copy in some seeds only).
LEARNING_VAULT = '''"""The vault whose codes only it knows (tests/tool_task.py: LEARNING_VAULT)."""


class Vault:
    def reset(self, box, code, **record):
        self.box, self.code, self.opened = int(box), int(code), []  # the record's code: in no prompt

    def open_box(self, box: int) -> str:
        """Open a box and read the code inside.

        Args:
            box: the number of the box to open
        """
        self.opened.append(int(box))
        return " " + str(self.code if int(box) == self.box else (self.code + 1) % 10)

    def get_reward(self) -> float:
        """0.5 for opening the box the prompt names."""
        return 0.5 if self.box in self.opened else 0.0


def opened_and_right(completions, environments, **kwargs):
    """1.0 when the prompt's box was opened and the last answer is its code: a rollout that calls and answers right."""
    return [float(e.box in e.opened and c[-1].get("content", "").strip() == f"code {e.code}")
            for c, e in zip(completions, environments)]
'''


def learning_records(n: int, seed: int = 0) -> list[dict]:
    """{"prompt": "open box B", "box", "code"} records for LEARNING_VAULT, boxes and codes drawn from `seed`."""
    rng = random.Random(seed)
    return [{"prompt": [{"role": "user", "content": f"open box {box}"}], "box": box, "code": code}
            for box, code in ((rng.randrange(10), rng.randrange(10)) for _ in range(n))]


def learning_demonstrations(n: int, seed: int = 0, unknown: float = 0.5) -> list[dict]:
    """Chat records on learning_records' prompts: a share `unknown` answers at once without calling ("unknown"), the
    rest call the prompt's box and answer "code N" from the vault's answer, so that a model fine-tuned on them calls
    only part of the time and GRPO has the share that calls (and answers right) to raise."""
    rng = random.Random(seed + 1)
    out = []
    for r in learning_records(n, seed):
        if rng.random() < unknown:
            turns = [{"role": "assistant", "content": "unknown"}]
        else:
            call = {"type": "function", "function": {"name": "open_box", "arguments": {"box": r["box"]}}}
            turns = [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "name": "open_box", "content": f" {r['code']}"},
                     {"role": "assistant", "content": f"code {r['code']}"}]
        out.append({"messages": [*r["prompt"], *turns], "tools": [SCHEMA]})
    return out


SCHEMA = {"type": "function", "function": {
    "name": "open_box", "description": "Open a box and read the code inside.",
    "parameters": {"type": "object", "properties": {"box": {"type": "integer",
                                                            "description": "the number of the box to open"}},
                   "required": ["box"]}, "return": {"type": "string"}}}


def make_tokenizer(directory: Path | None = None, vocab_size: int = 600, compact: bool = False) -> Any:
    """The BPE (see the module's docstring), its chat template Qwen 2.5's (`compact`: COMPACT, with RESPONSE as its
    response_template), saved to `directory` when given."""
    from bigtrain.data.tokenizer import train_bpe
    tpl = COMPACT if compact else template()
    bare = train_bpe(["render"], 300)  # only for rendering the texts the real one learns from
    bare.chat_template = tpl
    texts = []
    for d in demonstrations(200):
        texts.append(bare.apply_chat_template(d["messages"], tools=d["tools"], tokenize=False))
    texts += [f"there is no box {b} {{'error': 'Tool open_box not found.'}}" for b in range(20)]
    tok = train_bpe(texts, vocab_size)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = tpl
    if compact:
        tok.response_template = RESPONSE
    if directory is not None:
        tok.save_pretrained(str(directory))
    return tok


def make_model(tokenizer: Any, seed: int = 0, directory: Path | None = None, layers: int = 2, width: int = 64) -> Any:
    """A tiny random Llama for the tokenizer's vocabulary, saved to `directory` when given."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id))
    if directory is not None:
        model.save_pretrained(directory)
    return model


def write_vault(path: Path) -> Path:
    path.write_text(VAULT.format(codes=CODES))
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def calls_wanted(ticket: int) -> int:
    """How many calls the scripted model makes for a prompt (its ticket decides): 3 for even tickets, else 1."""
    return 3 if ticket % 2 == 0 else 1


def scripted_turn(tok: Any, context: list[int], seed: int) -> list[int]:
    """The scripted model's next turn after `context` (the prompt and the completion so far): a call to open_box
    until it has made calls_wanted(ticket) (now and then a call of a box that is not there, or broken JSON: failures),
    then an answer (mostly the last code the vault gave). Seeded by (context, seed) alone: the same on any rank."""
    import re
    rng = random.Random(hash((tuple(context), seed)))
    text = tok.decode(context, skip_special_tokens=False)
    ticket, box = map(int, re.findall(r"ticket (\d+): open box (\d+)", text)[-1])
    answers = re.findall(r"(?:<tool_response>\n|<\|im_start\|>tool\n)(.*?)(?:\n</tool_response>|<\|im_end\|>)", text,
                         re.DOTALL)
    if len(answers) < calls_wanted(ticket):
        draw = rng.random()
        turn = call_text(box) if draw < 0.7 else call_text(box + 10) if draw < 0.85 else \
            '<tool_call>\n{"name": "open_box", "arguments": {box\n</tool_call>'
    else:
        digits = [a for a in answers if a.isdigit()]
        turn = digits[-1] if digits and rng.random() < 0.7 else str(rng.randrange(10))
    return tok.encode(turn, add_special_tokens=False) + [tok.eos_token_id]


def scripted_generate(tok: Any, prompt_ids: Any, prompt_mask: Any, sampling: Any) -> Any:
    """A generation round of the scripted model (a bigtrain.rollout.generate.Rollout): each row's turn, the rows
    whose contexts are alike told apart by their place among them, cut at max_new_tokens."""
    import torch
    from bigtrain.rollout.generate import Rollout
    n, width = sampling.num_generations, sampling.max_new_tokens
    contexts = [row[m.bool()].tolist() for row, m in zip(prompt_ids, prompt_mask) for _ in range(n)]
    seen: dict = {}
    turns = []
    for context in contexts:
        seen[tuple(context)] = seen.get(tuple(context), -1) + 1
        turns.append(scripted_turn(tok, context, seen[tuple(context)])[:width])
    longest = max(map(len, turns))
    ids = torch.full((len(turns), longest), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(turns), longest), dtype=torch.long)
    for i, t in enumerate(turns):
        ids[i, :len(t)], mask[i, :len(t)] = torch.tensor(t), 1
    cut = torch.tensor([t[-1] != tok.eos_token_id for t in turns])
    device = prompt_ids.device
    return Rollout(prompt_ids.repeat_interleave(n, 0), prompt_mask.repeat_interleave(n, 0), ids.to(device),
                   mask.to(device), cut.to(device))
