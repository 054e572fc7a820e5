"""Reward functions (bigtrain/rollout/rewards.py, builtin_rewards.py, reward_model.py): loaded by file path, by
module name (TRL's own think_format_reward among them) and by built-in name, called with TRL's keywords (every
record column arrives), weighted, scored None -> NaN -> advantage 0; every way a user's reward goes wrong is one
line naming the function and the record; a reward-model directory is scored at each row's last real token (a batch
of different lengths scores as each row alone, whatever pad id the tokenizer and the config hold)."""
from __future__ import annotations

import math
import textwrap

import pytest
import torch

from messages import naming

from bigtrain.rollout.advantages import combine_rewards, group_advantages
from bigtrain.rollout.builtin_rewards import accuracy, answers_match, final_answer, format_reward, length_reward
from bigtrain.rollout.metrics import reward_metrics
from bigtrain.rollout.rewards import load_function, load_rewards, score


def write(path, text: str):
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def user_file(tmp_path):
    return write(tmp_path / "my_rewards.py", """
        def exact(prompts, completions, completion_ids, answer, **kwargs):
            return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

        def short(completion_ids, **kwargs):
            return [None if len(ids) == 0 else -len(ids) for ids in completion_ids]

        def seen(prompts, completions, completion_ids, trainer_state, log_metric, **columns):
            log_metric("calls", 1)
            return [float(columns["level"][i] + trainer_state.global_step) for i in range(len(prompts))]

        def boom(completions, answer, **kwargs):
            return [1 / 0 if a == "boom" else 1.0 for a in answer]

        def too_few(completions, **kwargs):
            return [1.0]

        def nan(completions, **kwargs):
            return [float("nan")] * len(completions)

        def text(completions, **kwargs):
            return ["yes"] * len(completions)
        """)


PROMPTS = ["what is 2+2?", "what is 2+2?", "name a color", "name a color"]
COMPLETIONS = [" 4", " five", " red", ""]
IDS = [[7], [8, 9], [10], []]
RECORDS = [{"answer": "4", "level": 1}, {"answer": "4", "level": 1}, {"answer": "red", "level": 2},
           {"answer": "red", "level": 2}]


def test_user_functions_get_trls_keywords_and_are_weighted(user_file):
    functions = load_rewards([f"{user_file}:exact", f"{user_file}:short", f"{user_file}:seen"], [2.0, 0.5, 1.0],
                             max_completion_length=8)
    assert [f.name for f in functions] == ["exact", "short", "seen"]
    out = score(functions, PROMPTS, COMPLETIONS, IDS, RECORDS, step=10)
    assert out.per_function[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert out.per_function[:3, 1].tolist() == [-1.0, -2.0, -1.0] and math.isnan(out.per_function[3, 1])
    assert out.per_function[:, 2].tolist() == [11.0, 11.0, 12.0, 12.0]  # a column and the step arrive
    assert out.metrics == {"calls": [1.0]}
    rewards = combine_rewards(out.per_function, torch.tensor([f.weight for f in functions]))
    assert rewards.tolist() == pytest.approx([2 - 0.5 + 11, -1 + 11, 2 - 0.5 + 12, 12])


def test_module_functions_and_a_none_everywhere_completion(tmp_path, monkeypatch):
    write(tmp_path / "rewards_pkg.py", """
        def maybe(completions, **kwargs):
            return [None if c == "" else 1.0 for c in completions]
        """)
    monkeypatch.syspath_prepend(str(tmp_path))
    functions = load_rewards(["rewards_pkg:maybe", "rewards_pkg:maybe"], max_completion_length=8)
    assert [f.name for f in functions] == ["maybe", "maybe_2"]
    out = score(functions, PROMPTS, COMPLETIONS, IDS, RECORDS)
    rewards = combine_rewards(out.per_function)
    assert math.isnan(rewards[3])  # every function said None: unscorable
    advantages, _ = group_advantages(torch.tensor([1.0, 0.0, 1.0, float("nan")]), 2)
    assert advantages[3] == 0.0


def test_trls_own_reward_functions_load_by_module_name():
    trl_rewards = pytest.importorskip("trl.rewards")
    think = load_function("trl.rewards:think_format_reward")
    completions = [[{"role": "assistant", "content": "<think>\nhmm\n</think>\n4"}],
                   [{"role": "assistant", "content": "4"}]]
    functions = load_rewards(["trl.rewards:think_format_reward", "format", "length=10,4"], max_completion_length=10)
    out = score(functions, [[{"role": "user", "content": "q"}]] * 2, completions, [[1] * 5, [1] * 8],
                [{}, {}])
    assert out.per_function[:, 0].tolist() == think(completions) == [1.0, 0.0]
    assert out.per_function[:, 1].tolist() == [1.0, 0.0]  # the built-in format = TRL's think format
    overlong = trl_rewards.get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)
    for n in (3, 6, 8, 10, 12):
        assert length_reward(10, 4)(completion_ids=[[1] * n]) == overlong([[1] * n])


@pytest.mark.parametrize("predicted,gold,same", [
    ("1,000", "1000.0", True), ("\\boxed{\\frac{1}{2}}", "0.5", True), ("50%", "50", True), ("$3.50", "3.5", True),
    ("1e3", "1000", True), ("\\boxed{\\text{Paris}}", "paris", True), ("41", "42", False), ("1/3", "0.333", False),
    ("\\boxed{x+1}", "x + 1", True), ("\\boxed{x+2}", "x + 1", False)])
def test_answers_are_normalised(predicted, gold, same):
    assert answers_match(final_answer(predicted), gold) is same


def test_accuracy_reads_the_final_answer_and_skips_records_without_one():
    completions = ["so 2+2 = 4", "The answer is 5.", "first 3 then \\boxed{12}", "#### 1,234", "no number here"]
    answers = ["4", "5", "12", "1234", "7"]
    assert accuracy(completions, answers) == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert accuracy(["4"], ["#### 4"]) == [1.0]  # a GSM8K-style solution as the answer
    assert accuracy(["4", "4"], [None, ""]) == [None, None]
    with pytest.raises(ValueError, match="'answer' column"):
        accuracy(["4"])
    assert format_reward(r"<answer>\d+</answer>")(completions=["<answer>4</answer>", "4"]) == [1.0, 0.0]


def test_bad_reward_functions_are_one_line(user_file, tmp_path):
    def error(spec: str, records=RECORDS) -> str:
        with pytest.raises(ValueError) as info:
            score(load_rewards([spec], max_completion_length=8), PROMPTS, COMPLETIONS, IDS, records)
        message = str(info.value)
        assert "\n" not in message and "Traceback" not in message
        return message

    boom = error(f"{user_file}:boom", [*RECORDS[:2], {"answer": "boom", "level": 2}, RECORDS[3]])
    assert "'boom'" in boom and "ZeroDivisionError" in boom and "completion 2" in boom and "name a color" in boom
    assert "returned 1 rewards for 4" in error(f"{user_file}:too_few")
    assert "returned nan" in error(f"{user_file}:nan") and "completion 0" in error(f"{user_file}:nan")
    assert "returned str 'yes'" in error(f"{user_file}:text")

    def load_error(spec: str) -> str:
        with pytest.raises(ValueError) as info:
            load_rewards([spec], max_completion_length=8)
        assert "\n" not in str(info.value)
        return str(info.value)

    broken = write(tmp_path / "broken.py", "def f(:\n    pass\n")
    assert "SyntaxError" in load_error(f"{broken}:f") and "line 1" in load_error(f"{broken}:f")
    failing = write(tmp_path / "failing.py", "import not_a_module_anywhere\n")
    assert "ModuleNotFoundError" in load_error(f"{failing}:f")
    missing = load_error(f"{user_file}:exactly")
    assert "no 'exactly'" in missing and "exact" in missing and "short" in missing
    assert "no such file" in load_error(f"{tmp_path}/absent.py:f")
    assert "does not import" in load_error("no_such_package.rewards:f")
    assert "give path/to/file.py:function" in load_error("just_a_word")
    assert "quote it" in load_error("2")  # [rewards.py:exact,length=4,2]: the list's comma split length=4,2
    with pytest.raises(ValueError, match="2 weights for 1 rewards"):
        load_rewards(["accuracy"], [1.0, 2.0], max_completion_length=8)


def test_rewards_a_stranger_writes_that_passed_or_crashed_are_one_line_or_scored(tmp_path):
    """A stranger's rewards: 1e39 passed the float64 finite check and was inf among the float32 scores (the run
    exited 0 with reward inf); 10**400 and sys.exit() ended in a traceback or in silence; a dict was scored by its
    keys; a parameter naming no column blamed completion 0; an async def reward, which TRL awaits, was refused."""
    rewards = write(tmp_path / "stranger.py", """
        import sys

        def huge(completions, **kwargs):
            return [1e39] * len(completions)

        def bigint(completions, **kwargs):
            return [10 ** 400] * len(completions)

        def as_dict(completions, **kwargs):
            return {i: 1.0 for i in range(len(completions))}

        def leaves(completions, **kwargs):
            sys.exit(3)

        def typo(completions, answers, **kwargs):
            return [1.0] * len(completions)

        async def remote(completions, answer, **kwargs):
            return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

        async def remote_fails(completions, answer, **kwargs):
            if "red" in answer:
                raise ConnectionError("judge unreachable")
            return [1.0] * len(completions)

        async def remote_leaves(completions, **kwargs):
            sys.exit(4)
        """)

    def error(name: str) -> str:
        with pytest.raises(ValueError) as info:
            score(load_rewards([f"{rewards}:{name}"], max_completion_length=8), PROMPTS, COMPLETIONS, IDS, RECORDS)
        assert "\n" not in str(info.value)
        return str(info.value)

    assert "1e+39" in error("huge") and "float32" in error("huge")
    assert "completion 0" in error("bigint") and "float32" in error("bigint")
    assert "returned dict" in error("as_dict")
    assert "raised SystemExit: 3" in error("leaves")
    typo = error("typo")
    assert "'answers'" in typo and "answer" in typo and "level" in typo and "completion 0" not in typo
    scored = score(load_rewards([f"{rewards}:remote"], max_completion_length=8), PROMPTS, COMPLETIONS, IDS, RECORDS)
    assert scored.per_function[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]
    fails = error("remote_fails")  # awaited with the others: still the function and the record named
    assert "'remote_fails'" in fails and "ConnectionError: judge unreachable" in fails and "completion 2" in fails
    assert "raised SystemExit: 4" in error("remote_leaves")  # and the loop still serves the next round
    assert score(load_rewards([f"{rewards}:remote"], max_completion_length=8), PROMPTS, COMPLETIONS, IDS,
                 RECORDS).per_function[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]


def test_what_rewards_log_is_kept_and_async_rewards_run_together(tmp_path):
    """TRL's log_metric(name, value) and log_extra(column, values) are kept (the objective reports them: the step's
    metrics, the sample table); the async def functions are awaited together, as TRL's asyncio.gather does: two
    that each sleep 0.4 s take one sleep, not two, beside a synchronous one; and on one loop that outlives the
    round (a client kept between calls still works at the next step)."""
    import time
    rewards = write(tmp_path / "logging.py", """
        import asyncio

        LOOPS = []

        async def slow_a(completions, log_metric, log_extra, **kwargs):
            LOOPS.append(asyncio.get_running_loop())
            await asyncio.sleep(0.4)
            log_metric("judge/latency", 0.4)
            log_extra("judge_said", ["ok"] * len(completions))
            return [1.0] * len(completions)

        async def slow_b(completions, log_metric, **kwargs):
            await asyncio.sleep(0.4)
            log_metric("judge/latency", 0.2)
            return [2.0] * len(completions)

        def fast(completions, log_metric, log_extra, **kwargs):
            log_metric("fast/calls", 1)
            log_extra("length", [len(c) for c in completions])
            return [0.5] * len(completions)

        def twice(completions, log_extra, **kwargs):
            log_extra("length", [0] * len(completions))
            return [0.0] * len(completions)
        """)
    functions = load_rewards([f"{rewards}:slow_a", f"{rewards}:fast", f"{rewards}:slow_b"], max_completion_length=8)
    started = time.perf_counter()
    out = score(functions, PROMPTS, COMPLETIONS, IDS, RECORDS)
    seconds = time.perf_counter() - started
    assert 0.4 <= seconds < 0.75, seconds  # one after the other: 0.8
    assert out.per_function[0].tolist() == [1.0, 0.5, 2.0]
    assert out.metrics == {"fast/calls": [1.0], "judge/latency": [0.4, 0.2]}
    assert out.extra == {"length": [2, 5, 4, 0], "judge_said": ["ok"] * 4}
    score(functions, PROMPTS, COMPLETIONS, IDS, RECORDS)
    loops = functions[0].fn.__globals__["LOOPS"]
    assert len(loops) == 2 and loops[0] is loops[1] and loops[0].is_running()
    with pytest.raises(ValueError) as info:
        score(load_rewards([f"{rewards}:fast", f"{rewards}:twice"], max_completion_length=8), PROMPTS, COMPLETIONS,
              IDS, RECORDS)
    assert "\n" not in str(info.value) and "log_extra('length'" in str(info.value) and "8 values for 4" in str(
        info.value)


def test_a_reward_file_imports_its_helpers_beside_it_and_unscored_completions_are_said(tmp_path, caplog):
    """`from helper import norm` in rewards/my.py failed with No module named 'helper' (its folder was not on the
    path, as it is when the file runs as a script); completions no function scores trained on nothing in silence."""
    folder = tmp_path / "rewards"
    folder.mkdir()
    write(folder / "helper_for_bigtrain_test.py", "def norm(text):\n    return text.strip().lower()\n")
    mine = write(folder / "mine.py", """
        from helper_for_bigtrain_test import norm

        def exact(completions, answer, **kwargs):
            return [1.0 if norm(c) == norm(a) else 0.0 for c, a in zip(completions, answer)]

        def never(completions, **kwargs):
            return [None] * len(completions)
        """)
    scored = score(load_rewards([f"{mine}:exact"], max_completion_length=8), PROMPTS, COMPLETIONS, IDS, RECORDS)
    assert scored.per_function[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]
    import bigtrain.rollout.rewards as rewards
    rewards._said_unscored.clear()
    with caplog.at_level("WARNING", logger="bigtrain"):
        score(load_rewards([f"{mine}:never"], max_completion_length=8), PROMPTS, COMPLETIONS, IDS, RECORDS)
    assert naming(caplog.text, "returned None for 4 of 4 completions", "teach nothing"), caplog.text


def test_reward_metrics_are_trls():
    per_function = torch.tensor([[1.0, 0.5], [1.0, 0.5], [float("nan"), float("nan")], [1.0, 1.0]])
    rewards = combine_rewards(per_function, torch.tensor([1.0, 2.0]))
    _, std_zero = group_advantages(rewards, 2)
    metrics = reward_metrics(per_function, ["a", "b"], torch.tensor([1.0, 2.0]), std_zero)
    scorable = [2.0, 2.0, 3.0]  # the unscorable completion is left out of reward and reward_std
    assert metrics["reward"] == pytest.approx(sum(scorable) / 3)
    assert metrics["reward_std"] == pytest.approx(torch.tensor(scorable).std().item())
    assert metrics["rewards/a/mean"] == pytest.approx(1.0) and metrics["rewards/b/mean"] == pytest.approx(2 / 3)
    # the first group scored alike (no signal); the second has one scorable completion, whose std is undefined
    assert metrics["frac_reward_zero_std"] == 0.5


def test_logged_metrics_are_the_mean_of_every_ranks_values(monkeypatch):
    """log_metric's values of every rank averaged (TRL's: their sum over their count), for a name some rank did
    not log too: rank 0 logged a twice, rank 1 (its side of the two collectives played here) a once and b once."""
    from bigtrain.rollout.metrics import logged_metrics
    theirs = {"a": (2.0, 1.0), "b": (5.0, 1.0)}
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed, "all_gather_object", lambda out, mine: out.__setitem__(
        slice(None), [mine, sorted(theirs)]))
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda flat: flat.add_(torch.tensor(
        [theirs[name] for name in ("a", "b")], dtype=flat.dtype)))
    assert logged_metrics({"a": [1.0, 3.0]}, "cpu") == {"a": 2.0, "b": 5.0}


def reward_model_dir(root, pad_token: str | None, config_pad: str | None):
    """A tiny Llama reward model (one label) with the test chat tokenizer, its tokenizer's pad and its config's
    pad_token_id set as asked (None: left unset)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from local_chat import make_chat_tokenizer
    tok = make_chat_tokenizer(root)
    if pad_token is not None:
        tok.pad_token = pad_token
        tok.save_pretrained(str(root))
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                         pad_token_id=None if config_pad is None else tok.convert_tokens_to_ids(config_pad))
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(root)
    return root


@pytest.mark.parametrize("pad_token,config_pad", [(None, "<|endoftext|>"), ("<|eot_id|>", "<|endoftext|>"),
                                                  (None, None)])
def test_a_reward_model_scores_each_row_at_its_last_token(tmp_path, pad_token, config_pad):
    """Rows of different lengths in one batch score as each alone (no padding to read past), whichever pad id
    the tokenizer has and whatever (or nothing) the config's pad_token_id is."""
    directory = reward_model_dir(tmp_path / "rm", pad_token, config_pad)
    [reward] = load_rewards([str(directory)], max_completion_length=8)
    assert reward.name == "rm"
    prompts = ["the cat sat", "hello there how are you", [{"role": "user", "content": "good morning"}]]
    completions = [" on a mat and we ask what is two plus two", " fine",
                   [{"role": "assistant", "content": "the sea and the mountains"}]]
    batch = score([reward], prompts, completions, [[1]] * 3, [{}] * 3).per_function[:, 0]
    alone = torch.tensor([reward.fn(prompts=[p], completions=[c])[0] for p, c in zip(prompts, completions)])
    rows = reward.fn.token_rows(prompts, completions)
    assert len({len(r) for r in rows}) == 3  # three lengths: the two shorter rows are padded in the batch
    assert torch.allclose(batch, alone, atol=1e-5), (batch, alone)
    # the score is the classifier head at the last real token: here, the row's final end-of-text (or the token
    # before it, where the pad id is the end-of-text itself: transformers skips it, as it did in training)
    module = reward.fn.module
    with torch.no_grad():
        ids = torch.tensor([rows[0]])
        hidden = module.model(input_ids=ids).last_hidden_state[0]
        at = len(rows[0]) - 1 - int(rows[0][-1] == reward.fn.pad_id)
        assert module.score(hidden[at]).item() == pytest.approx(batch[0].item(), abs=1e-5)


def test_not_a_reward_model_is_one_line(tmp_path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from local_chat import make_chat_tokenizer
    tok = make_chat_tokenizer(tmp_path)
    LlamaForSequenceClassification(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=4, num_labels=3)
                                   ).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="one output .num_labels=1.; this one has 3"):
        load_rewards([str(tmp_path)], max_completion_length=8)
