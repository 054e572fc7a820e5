"""Agentic RL's parts without a launcher: objective.tools / objective.environment as settings, tools and environments
loaded (one line for each mistake), calls run side by side with their timeout, the tool-call formats read, a chat
template's fitness for tools, and the multi-turn round on a scripted model (tests/tool_task.py): the completion is
the template's own render of the conversation, the model's tokens alone in the loss's mask, the budget's rollback,
the rounds' limit and the tools' metrics."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import tool_task as tt
from bigtrain.rollout.generate import Sampling
from messages import naming

TOOLS = '''import asyncio
import time


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


async def slow_add(a: int, b: int) -> int:
    """Add two numbers, slowly.

    Args:
        a: the first
        b: the second
    """
    await asyncio.sleep(a)
    return a + b


def sleepy(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "awake"


def broken(x: int) -> int:
    """Raise.

    Args:
        x: anything
    """
    raise KeyError("no such thing")


def no_hints(a):
    """No type hints.

    Args:
        a: something
    """


def no_docstring(a: int) -> int:
    return a


class NoReset:
    def look(self, x: int) -> int:
        """Look.

        Args:
            x: where
        """
        return x
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("agentic")
    (root / "tools.py").write_text(TOOLS)
    (root / "broken.py").write_text("import not_a_module_anywhere\n")
    tt.write_vault(root / "vault.py")
    return root


@pytest.fixture(scope="module")
def tok():
    return tt.make_tokenizer()


SEQ = ["data.seq_len=1024"]
# TRL 1.16's response template for Qwen 3 (trl.chat_template_utils.qwen3_template, whose import takes seconds)
QWEN3_RESPONSE = {"defaults": {"role": "assistant"}, "start_anchor": "<|im_start|>assistant\n", "fields": {
    "reasoning_content": {"open": "<think>", "close_pattern": "</think>\\s*", "content": "text"},
    "tool_calls": {"open": "<tool_call>", "close_pattern": "</tool_call>\\s*", "repeats": True, "content": "json",
                   "transform": {"type": "function", "function": "{content}"}},
    "content": {"close_pattern": "<\\|im_end\\|>\\s*", "content": "text"}}}


# -- settings ---------------------------------------------------------------------------------------------------------

def test_settings_take_trls_forms_and_refuse_others_in_one_line():
    from bigtrain.config.load import load_run_config
    run = load_run_config(overrides=[*SEQ, "objective.kind=grpo",
                                     "objective.environment=[math=envs.py:Math, game=g.py:G]",
                                     "objective.tools=t.py:add"])
    s = run.objective.settings
    assert s.environments == {"math": "envs.py:Math", "game": "g.py:G"} and s.tools == ["t.py:add"] and s.uses_tools
    assert s.max_tool_calling_iterations is None and s.tool_timeout == 60.0
    one = load_run_config(overrides=[*SEQ, "objective.kind=rloo", "objective.environment=envs.py:Vault"]).objective
    assert one.settings.environments == {None: "envs.py:Vault"}  # no reward named: the environment's get_reward
    mapping = load_run_config(overrides=SEQ, base={"objective": {"kind": "distill", "teacher": "t",
                                                                 "environment": {"a": "x.py:A"}}})
    assert mapping.objective.settings.environments == {"a": "x.py:A"}
    for bad, said in ((["objective.environment=[a=x.py:A, x.py:B]"], "each of several needs its own name"),
                      (["objective.max_tool_calling_iterations=0"], "must be >= 1"),
                      (["objective.tool_timeout=0"], "must be > 0 seconds"),
                      (["objective.tools=[t.py:f, '']"], "give path/to/file.py:function")):
        with pytest.raises(ValueError) as e:
            load_run_config(overrides=[*SEQ, "objective.kind=grpo", "objective.rewards=accuracy", *bad]).objective
        assert said in str(e.value) and len(str(e.value).splitlines()) == 1, str(e.value)
    with pytest.raises(ValueError, match="or an objective.environment with a get_reward"):
        load_run_config(overrides=[*SEQ, "objective.kind=grpo", "objective.tools=t.py:add"]).objective


# -- tools and environments -----------------------------------------------------------------------------------------

def test_tools_load_with_their_schemas_and_each_mistake_is_one_line(files):
    from bigtrain.rollout.environments import Toolbox
    box = Toolbox([f"{files}/tools.py:add", f"{files}/tools.py:slow_add"], {None: f"{files}/vault.py:Vault"})
    assert [t.name for t in box.tools] == ["add", "slow_add"]
    assert box.tools[0].schema["function"]["parameters"]["properties"]["a"]["type"] == "integer"
    assert [t.schema["function"]["name"] for t in box.methods[None]] == ["open_box"]  # not reset, not get_reward
    assert [name for name, _, _ in box.reward_functions()] == ["Vault"]
    cases = {f"{files}/tools.py:no_hints": ("objective.tools", "no_hints", "missing a type hint"),
             f"{files}/tools.py:no_docstring": ("objective.tools", "no_docstring", "no docstring"),
             f"{files}/broken.py:f": ("broken.py", "does not import", "not_a_module_anywhere"),
             f"{files}/tools.py:nothing": ("has no 'nothing'", "add"),
             "add": ("objective.tools 'add'", "path/to/file.py:NAME")}
    for spec, said in cases.items():
        with pytest.raises(ValueError) as e:
            Toolbox([spec], None)
        assert naming(str(e.value), *said), str(e.value)
    with pytest.raises(ValueError) as e:
        Toolbox([], {None: f"{files}/tools.py:NoReset"})
    assert naming(str(e.value), "objective.environment", "NoReset", "has no reset method"), str(e.value)
    with pytest.raises(ValueError) as e:
        Toolbox([f"{files}/vault.py:Vault"], None)
    assert naming(str(e.value), "is a class", "objective.environment"), str(e.value)
    named = Toolbox([], {"vault": f"{files}/vault.py:Vault", "other": f"{files}/vault.py:Vault"})
    assert len(named.reward_functions()) == 1  # one class under two names: scored once
    with pytest.raises(ValueError) as e:
        named.check_records([{"prompt": [], "environment": "vault"}, {"prompt": [], "environment": "safe"}])
    assert naming(str(e.value), "record 2", "environment='safe'", "vault, other"), str(e.value)


def test_calls_run_side_by_side_and_whatever_goes_wrong_is_the_tools_answer(files):
    from bigtrain.rollout.environments import Toolbox
    from bigtrain.rollout.tools import Call, run_calls
    box = Toolbox([f"{files}/tools.py:{n}" for n in ("add", "slow_add", "sleepy", "broken")], None)
    tools = box.callables(None)
    calls = [[Call("add", {"a": 1, "b": 2}), Call("slow_add", {"a": 0.3, "b": 1})],
             [Call("sleepy", {"seconds": 0.3})], [Call("sleepy", {"seconds": 30})], [Call("broken", {"x": 1})],
             [Call("nope", {})], [Call("add", {"a": 1})], [Call("add", [1, 2])], [Call("x", None, "broken JSON")], []]
    started = time.perf_counter()
    results = run_calls(calls, [tools] * len(calls), timeout=1.0)
    took = time.perf_counter() - started
    assert took < 2.5, took  # side by side, the 30 s one cut at 1 s
    assert [(r.content, r.failed) for r in results[0]] == [("3", False), ("1.3", False)]
    assert (results[1][0].content, results[1][0].failed) == ("awake", False)
    said = [r[0].content for r in results[2:8]]
    assert all(r[0].failed for r in results[2:8]) and results[8] == []
    for text, want in zip(said, (["sleepy did not answer within 1 s"], ["no such thing"], ["Tool nope not found."],
                                 ["missing 1 required", "'b'"], ["must be a JSON object", "list"], ["broken JSON"])):
        assert text.startswith("{'error': ") and naming(text, *want), text
    assert results[3][0].message() == {"role": "tool", "name": "broken", "content": results[3][0].content}


# -- formats ----------------------------------------------------------------------------------------------------------

def test_calls_are_read_in_each_familys_format(tok):
    from bigtrain.rollout.tool_format import ToolFormat, family
    hermes = ToolFormat(tok, [tok.eos_token_id])
    ids = tok.encode("let me look " + tt.call_text(3) + tt.call_text("x", "other"), add_special_tokens=False)
    message, calls = hermes.parse(ids + [tok.eos_token_id], [], [])
    assert message["content"] == "let me look" and [(c.name, c.arguments) for c in calls] == [
        ("open_box", {"box": 3}), ("other", {"box": "x"})]
    assert message["tool_calls"][1] == {"type": "function", "function": {"name": "other", "arguments": {"box": "x"}}}
    _, (bad,) = hermes.parse(tok.encode('<tool_call>\n{"name": "f", "arguments": {x}\n</tool_call>',
                                        add_special_tokens=False), [], [])
    assert bad.error is not None and "not valid JSON" in bad.error
    assert hermes.parse(tok.encode("just 7", add_special_tokens=False), [], []) == (
        {"role": "assistant", "content": "just 7"}, [])
    from bigtrain.rollout.tool_format import _llama3, _mistral
    assert [(c.name, c.arguments) for c in _llama3('<|python_tag|>{"name": "f", "parameters": {"a": 1}}')[1]] == \
        [("f", {"a": 1})]
    assert _llama3("plain words")[1] == []
    assert [(c.name, c.arguments) for c in _mistral('ok[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, '
                                                     '{"name": "g", "arguments": "{\\"b\\": 2}"}]')[1]] == \
        [("f", {"a": 1}), ("g", {"b": 2})]
    assert [(c.name, c.arguments) for c in _mistral('[TOOL_CALLS]f[ARGS]{"a": 1}g[ARGS]{"b": 2}')[1]] == \
        [("f", {"a": 1}), ("g", {"b": 2})]
    parsed = tok
    saved = getattr(parsed, "response_template", None)
    parsed.response_template = QWEN3_RESPONSE  # the tokenizer's own parser (transformers' parse_response) first
    try:
        assert family(parsed) == "response_template"
        schema = ToolFormat(parsed, [tok.eos_token_id])
        _, calls = schema.parse(tok.encode(tt.call_text(4), add_special_tokens=False) + [tok.eos_token_id],
                                tok.encode("<|im_start|>assistant\n", add_special_tokens=False), [tt.SCHEMA])
        assert [(c.name, c.arguments) for c in calls] == [("open_box", {"box": 4})]
    finally:
        parsed.response_template = saved


def test_a_template_that_cannot_do_tools_is_one_line_saying_which_would(tok, tmp_path):
    from local_chat import LLAMA_TEMPLATE, make_chat_tokenizer

    from bigtrain.rollout.tool_format import template_problem
    assert template_problem(tok) is None
    plain = make_chat_tokenizer(tmp_path / "plain", LLAMA_TEMPLATE)
    said = template_problem(plain)
    assert naming(said, "drops the call", "qwen2_5.jinja", "data.chat_template"), said
    plain.chat_template = None
    assert naming(template_problem(plain), "no chat template"), template_problem(plain)
    plain.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if m.tool_calls %}"
                           "{{ m.tool_calls | tojson }}{% endif %}\n{% endfor %}")
    assert naming(template_problem(plain), "cannot read the calls", "response_template"), template_problem(plain)


# -- the round --------------------------------------------------------------------------------------------------------

class Scripted:
    """A policy whose generation is tests/tool_task.py's scripted model."""

    device = "cpu"

    def __init__(self, tok):
        self.tokenizer = tok
        self.calls = 0

    def generate(self, ids, mask, sampling, rng, gather=None):
        self.calls += 1
        return tt.scripted_generate(self.tokenizer, ids, mask, sampling)

    def stop_ids(self):
        return [self.tokenizer.eos_token_id]


def agent_of(files: Path, budget: int, rounds: int | None = None):
    from bigtrain.rollout.agent import Agent
    from bigtrain.rollout.environments import Toolbox
    return Agent(Toolbox([], {None: f"{files}/vault.py:Vault"}), budget, rounds, 5.0)


def test_a_round_is_the_templates_own_render_with_the_models_tokens_alone_in_the_loss(files, tok):
    records = tt.records(6)
    rollout = agent_of(files, 400).rollout(Scripted(tok), records, Sampling(400, num_generations=2), None)
    eos = tok.eos_token_id
    turns = 0
    for i, record in enumerate(r for r in records for _ in range(2)):
        length = int(rollout.context_mask[i].sum())
        completion = rollout.completion_ids[i, :length].tolist()
        prompt = rollout.prompt_ids[i][rollout.prompt_mask[i].bool()].tolist()
        conversation = rollout.conversations[i]
        whole = tok.apply_chat_template(record["prompt"] + conversation, tools=[tt.SCHEMA], tokenize=True,
                                        return_dict=False)
        assert whole == prompt + completion + tok.encode("\n", add_special_tokens=False), i  # the template's own
        model = rollout.completion_mask[i, :length].tolist()
        results = [m for m in conversation if m["role"] == "tool"]
        suffixes = [tok.decode([t for t, m in group]) for zero, group in _runs(zip(completion, model)) if zero]
        rounds = sum(1 for zero, _ in _runs([(0, m["role"] == "tool") for m in conversation]) if not zero)
        assert len(suffixes) == rounds  # one suffix after each turn whose results were kept
        for suffix in suffixes:
            assert suffix.startswith("\n<|im_start|>user\n<tool_response>") and \
                suffix.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n"), suffix
        assert sum(s.count("<tool_response>") for s in suffixes) == len(results)
        kept = tok.decode([t for t, m in zip(completion, model) if m])
        assert "<tool_response>" not in kept
        assert kept.count("<|im_end|>") == sum(m["role"] == "assistant" for m in conversation)
        assert completion[-1] == eos and not rollout.truncated[i]
        turns += sum(m["role"] == "assistant" for m in conversation)
    assert rollout.metrics["tools/turns"] == pytest.approx(turns / 12)
    calls = sum(m["role"] == "tool" for c in rollout.conversations for m in c)
    failures = sum(m["role"] == "tool" and "error" in m["content"] for c in rollout.conversations for m in c)
    assert rollout.metrics["tools/call_frequency"] == pytest.approx(calls / 12)
    assert rollout.metrics["tools/failure_frequency"] == pytest.approx(failures / calls) and 0 < failures < calls
    assert [e.box for e in rollout.environments] == [r["box"] for r in records for _ in range(2)]
    assert rollout.completion_lists()[0] == rollout.completion_ids[0, :int(rollout.context_mask[0].sum())].tolist()


SAFE = '''class Safe:
    def reset(self, **record):
        self.record = record

    def crack(self, code: int) -> str:
        """Try a code on the safe.

        Args:
            code: the code to try
        """
        return "open" if code == 7 else "shut"
'''


def test_several_environments_each_records_own_with_only_its_tools_in_the_prompt(files, tok):
    """objective.environment=[vault=..., safe=...]: each record's `environment` column picks the class its rollouts
    act in; its prompt shows that environment's tools alone, and a call of another's is an unknown tool."""
    from bigtrain.rollout.agent import Agent
    from bigtrain.rollout.environments import Toolbox
    (files / "safe.py").write_text(SAFE)
    box = Toolbox([], {"vault": f"{files}/vault.py:Vault", "safe": f"{files}/safe.py:Safe"})
    records = [{**r, "environment": "vault" if i % 2 else "safe"} for i, r in enumerate(tt.records(4))]
    rollout = Agent(box, 400, 1, 5.0).rollout(Scripted(tok), records, Sampling(400, num_generations=2), None)
    opened = []
    for i, record in enumerate(r for r in records for _ in range(2)):
        environment, conversation = rollout.environments[i], rollout.conversations[i]
        prompt = tok.decode(rollout.prompt_ids[i][rollout.prompt_mask[i].bool()])
        results = [m["content"] for m in conversation if m["role"] == "tool"]
        unknown = [r for r in results if "Tool open_box not found" in r]
        if record["environment"] == "vault":
            assert type(environment).__name__ == "Vault" and environment.box == record["box"]
            assert '"open_box"' in prompt and '"crack"' not in prompt and not unknown, results
            opened += [r for r in results if r == str(record["code"])]
        else:
            assert type(environment).__name__ == "Safe" and "environment" not in environment.record
            assert environment.record["box"] == record["box"]
            assert '"crack"' in prompt and '"open_box"' not in prompt
            assert all("error" in r for r in results) and (unknown or not results), results
            opened += [None] * len(unknown)
    assert None in opened and any(o is not None for o in opened), opened  # a vault opened, a safe's call unknown


def test_a_round_shuffled_over_several_steps_keeps_each_rows_turns_and_results(files, tok):
    """objective.steps_per_generation > 1: the round's rows, shuffled and cut again, each keep their whole context
    (the results between the model's turns attended to) and the model's mask, not just as many tokens as the
    model wrote."""
    from bigtrain.objectives.round_pieces import split_rollout
    from bigtrain.rollout.generation_batch import shuffled
    rollout = agent_of(files, 400).rollout(Scripted(tok), tt.records(4), Sampling(400, num_generations=2), None)
    order = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])
    pieces = shuffled(split_rollout(rollout, 2), order, 2)
    rows = [row for p in pieces for row in zip(p.completion_ids, p.completion_mask, p.context_mask, p.rows[3])]
    assert len(rows) == 8
    for (ids, model, context, attended), i in zip(rows, order.tolist()):
        n = int(rollout.context_mask[i].sum())
        assert ids[:n].tolist() == rollout.completion_ids[i, :n].tolist(), i
        assert model[:n].tolist() == rollout.completion_mask[i, :n].tolist() and int(model.sum()) < n, i
        assert int(context.sum()) == n and attended.tolist() == context.tolist(), i


def test_the_budget_rolls_back_results_that_do_not_fit_and_the_rounds_stop_at_their_limit(files, tok):
    records = [r for r in tt.records(12) if tt.calls_wanted(int(r["prompt"][0]["content"].split()[1][:-1])) == 3]
    policy = Scripted(tok)
    once = agent_of(files, 400, rounds=1).rollout(policy, records[:2], Sampling(400, num_generations=2), None)
    assert policy.calls == 2  # the first turn, and one after the one round of calls
    assert all(sum(m["role"] == "assistant" for m in c) <= 2 for c in once.conversations)
    assert all(sum(m["role"] == "tool" for m in c) <= 1 for c in once.conversations)
    tight = agent_of(files, 40).rollout(Scripted(tok), records[:2], Sampling(40, num_generations=2), None)
    for i, conversation in enumerate(tight.conversations):
        length = int(tight.context_mask[i].sum())
        assert length <= 40
        if tight.completion_ids[i, length - 1] == tok.eos_token_id:  # the call's turn ended; its results dropped
            assert conversation[-1]["role"] == "assistant" and not tight.truncated[i]
    assert any(c[-1].get("tool_calls") for c in tight.conversations)  # a call whose results did not fit
    assert tight.metrics["tools/call_frequency"] > 0


def _runs(pairs):
    """(is a run of the mask's zeros, [(token, mask), ...]) for each maximal run of equal mask values."""
    import itertools
    return [(key == 0, list(group)) for key, group in itertools.groupby(pairs, key=lambda p: p[1])]


# -- fine-tuning on tool use, and the checks before a launch ---------------------------------------------------------

def test_fine_tuning_on_tool_use_trains_the_calls_and_answers_and_shows_the_tools(tok):
    from bigtrain.data.chat import Renderer
    from bigtrain.data.formats import format_of
    record = tt.demonstrations(1)[0]
    assert format_of(set(record)) == "chat"
    ids, mask = Renderer(tok, "chat")(record)
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    code = record["messages"][2]["content"]
    assert trained == f"{tt.call_text(record['messages'][1]['tool_calls'][0]['function']['arguments']['box'])}" \
                      f"<|im_end|>\n{code}<|im_end|>\n", trained
    text = tok.decode(ids)
    assert '<tools>\n{"type": "function", "function": {"name": "open_box"' in text  # the tools reach the template
    assert f"<tool_response>\n{code}\n</tool_response>" in text and "<tool_response>" not in trained
    import json
    as_text = Renderer(tok, "chat")({**record, "tools": json.dumps(record["tools"])})
    assert as_text == (ids, mask)  # TRL's column as JSON text too
    with pytest.raises(ValueError, match="'tools' is dict"):
        Renderer(tok, "chat")({**record, "tools": record["tools"][0]})


@pytest.fixture(scope="module")
def checked(tmp_path_factory, files, tok) -> dict:
    from local_chat import LLAMA_TEMPLATE
    root = tmp_path_factory.mktemp("precheck")
    tok.save_pretrained(str(root / "tools_model"))
    plain = tt.make_tokenizer()
    plain.chat_template = LLAMA_TEMPLATE
    plain.save_pretrained(str(root / "plain_model"))
    tt.write_jsonl(root / "prompts.jsonl", tt.records(4))
    tt.write_jsonl(root / "named.jsonl", [{**r, "environment": "vault" if i != 2 else "safe"}
                                          for i, r in enumerate(tt.records(4))])
    return {"root": root, "files": files}


def precheck_line(checked: dict, *sets: str, model: str = "tools_model", data: str = "prompts.jsonl") -> str | None:
    from bigtrain.config.load import load_run_config
    from bigtrain.train.precheck import check_tools
    root = checked["root"]
    run = load_run_config(overrides=[*SEQ, "model.family=hf", f"model.pretrained={root / model}",
                                     f"data.source={root / data}", "objective.kind=grpo",
                                     f"objective.rewards=[{checked['files']}/vault.py:correct]", *sets])
    try:
        check_tools(run)
    except ValueError as e:
        assert len(str(e).splitlines()) == 1, str(e)
        return str(e)
    return None


def test_each_bad_input_is_one_line_before_the_launch(checked):
    files = checked["files"]
    vault = f"objective.environment={files}/vault.py:Vault"
    assert precheck_line(checked, vault) is None
    assert naming(precheck_line(checked, f"objective.tools={files}/broken.py:f"), "objective.tools", "broken.py",
                  "does not import", "not_a_module_anywhere")
    assert naming(precheck_line(checked, f"objective.tools={files}/tools.py:no_hints"), "no_hints",
                  "missing a type hint", "Google-style docstring")
    assert naming(precheck_line(checked, f"objective.environment={files}/tools.py:NoReset"), "NoReset",
                  "has no reset method")
    assert naming(precheck_line(checked, vault, model="plain_model"), "objective.tools / objective.environment",
                  "drops the call", "qwen2_5.jinja")
    named = f"objective.environment=[vault={files}/vault.py:Vault]"
    assert naming(precheck_line(checked, named, data="named.jsonl"), "named.jsonl: record 3", "environment='safe'",
                  "vault")


# -- bigtrain generate / chat with the same tools --------------------------------------------------------------------

OPEN_BOX = '''import sys
sys.path.insert(0, {tests!r})
from tool_task import CODES


def open_box(box: int) -> str:
    """Open a box and read the code inside.

    Args:
        box: the number of the box to open
    """
    return str(CODES[int(box)])
'''


def test_generate_and_chat_call_the_tools_and_answer_from_their_results(files, tok, tmp_path, capsys, monkeypatch):
    """The model's turns scripted (tests/tool_task.py) on top of a real tiny model directory: the call is run, its
    result shown and given back, and the answer after it is the completion; the prompt shows the tools."""
    from bigtrain.cli import main
    from bigtrain.generate import command
    tok.save_pretrained(str(tmp_path / "model"))
    tt.make_model(tok, 0, tmp_path / "model", layers=1)
    (tmp_path / "open_box.py").write_text(OPEN_BOX.format(tests=str(Path(__file__).resolve().parents[1])))
    prompts = []

    def scripted(model, tokenizer, ids, sampling, config, synced=False, streamer=None):
        """A call of box 3, then the code the tool answered."""
        import re
        prompts.append(tokenizer.decode(ids))
        answers = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", prompts[-1])
        return tokenizer.encode(answers[-1] if answers else tt.call_text(3), add_special_tokens=False) + \
            [tokenizer.eos_token_id]

    monkeypatch.setattr(command, "generate", scripted)
    out = tmp_path / "out.jsonl"
    code = main(["generate", str(tmp_path / "model"), "--prompt", "ticket 1: open box 3", "--tools",
                 f"{tmp_path}/open_box.py:open_box", "--out", str(out)])
    said = capsys.readouterr()
    assert code == 0, said.err
    record = __import__("json").loads(out.read_text())
    roles = [m["role"] for m in record["messages"]]
    assert roles[0] == "assistant" and roles[-1] == "assistant" and "tool" in roles, record
    assert record["messages"][1] == {"role": "tool", "name": "open_box", "content": str(tt.CODES[3])}
    assert f"[open_box] {tt.CODES[3]}" in said.err
    assert said.out.strip().splitlines()[-1] == record["completion"] == str(tt.CODES[3])
    assert '"name": "open_box"' in prompts[0] and "<tool_response>" in prompts[-1]
    assert main(["generate", str(tmp_path / "model"), "--prompt", "x", "--environment",
                 f"{files}/tools.py:NoReset"]) == 2
    assert naming(capsys.readouterr().err, "bigtrain generate: --environment", "NoReset", "has no reset method")
