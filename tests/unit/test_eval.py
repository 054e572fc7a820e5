"""`bigtrain eval` and train.eval_tasks without a launcher: the rank split reproduces one process's batches
exactly, `bigtrain eval` on a model directory equals lm-eval's own HFLM on it, every mistake is one line (an
unknown task with its nearest names, data that cannot be had, lm-eval missing or too old, a wrong TARGET), and the
scores' way to the config, the log, the plot and the run's RNG. Runs, exports and 2 ranks: tests/dist/test_eval_runs.py.

The tests that run lm-eval skip without it (`pip install 'bigtrain[eval]'`; scripts/setup.sh installs it)."""
from __future__ import annotations

import json
import os
import random
from importlib.metadata import PackageNotFoundError
from pathlib import Path

import numpy as np
import pytest
import torch

from local_eval import DOCS, TASKS, make_eval_files, make_task_folder
from messages import naming

from bigtrain import cli


@pytest.fixture(autouse=True)
def offline(monkeypatch) -> None:
    """No network: a hub dataset fails at once instead of after ~25 s of retries (datasets reads the switch at
    import, so the loaded module's constant is set too)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import sys
    if "datasets" in sys.modules:
        monkeypatch.setattr(sys.modules["datasets"].config, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return make_eval_files(tmp_path_factory.mktemp("eval"))


def _one_line(argv: list[str], capsys) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# -- the rank split ---------------------------------------------------------------------------------------------


def _requests(tok) -> list[tuple]:
    """lm-eval's tokenized loglikelihood requests: shared contexts with one-token continuations (HFLM scores them
    from one forward pass), longer continuations, and contexts of many lengths."""
    out = []
    for i, context in enumerate(["the cow", "the dog barks at the cat and", "a", "the owl hoots at night while the",
                                 "one two three four five six seven eight nine ten eleven twelve", "frogs"]):
        for continuation in [" moos", " woofs", " meows.", " croaks loudly", " quacks"][: 2 + i % 4]:
            ctx = tok(context)["input_ids"]
            whole = tok(context + continuation)["input_ids"]
            out.append(((context, continuation), ctx, whole[len(ctx):]))
    return out


def _recording(lm) -> list:
    calls: list = []
    model_call = lm._model_call

    def record(inps, *args, **kwargs):
        calls.append(tuple(map(tuple, inps.tolist())))
        return model_call(inps, *args, **kwargs)
    lm._model_call = record
    return calls


@pytest.mark.parametrize("batch_size", [1, 3, 4])
def test_each_rank_runs_the_batches_one_process_runs(files: dict[str, Path], batch_size: int) -> None:
    """The heart of 'N ranks give exactly what one gives': each rank's share of the requests goes through HFLM's
    own batching into exactly the batches one process forms, so every request meets the same padding and kernels."""
    pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bigtrain.eval.lm import RankSplitLM
    model = AutoModelForCausalLM.from_pretrained(str(files["llama"])).eval()
    tok = AutoTokenizer.from_pretrained(str(files["llama"]))
    requests = _requests(tok)
    one = RankSplitLM(model, tok, batch_size, progress=False)
    one_calls = _recording(one)
    answers = HFLM._loglikelihood_tokens(one, requests)
    shares, rank_calls, rank_answers = [], [], {}
    for rank in range(2):
        lm = RankSplitLM(model, tok, batch_size, rank=rank, world=2, progress=False)
        calls = _recording(lm)
        mine = lm._my_requests(requests, None)
        got = HFLM._loglikelihood_tokens(lm, [requests[i] for i in mine])
        shares.append(set(mine))
        rank_calls += calls
        rank_answers.update(zip(mine, got))
    assert shares[0].isdisjoint(shares[1]) and shares[0] | shares[1] == set(range(len(requests)))
    assert min(len(s) for s in shares) > 0  # both ranks work
    assert sorted(rank_calls) == sorted(one_calls)  # the same batches, split between the ranks
    assert [rank_answers[i] for i in range(len(requests))] == answers  # bit for bit


def test_bigtrain_eval_on_a_model_directory_equals_lm_evals_own_hflm(files: dict[str, Path], tmp_path: Path,
                                                                        capfd, monkeypatch) -> None:
    """What `lm_eval --model hf --model_args pretrained=DIR` builds (HFLM from the path), in this process. Its
    TaskManager reads the local folder alone: lm-eval's own index of ~15000 task files (8 CPU s here) changes
    nothing about a local task, and the command itself, index and all, is the reference in
    tests/dist/test_eval_runs.py (lm_eval_cli). Run from a folder outside any git checkout, whose commit lm-eval
    asks git for: git's `fatal: not a git repository` stays off the console."""
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    out = tmp_path / "results.json"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no checkout above it either
    assert cli.main(["eval", str(files["llama"]), "--tasks", ",".join(TASKS), "--include-path", str(files["tasks"]),
                     "--batch-size", "4", "--out", str(out)]) == 0
    printed, errors = capfd.readouterr()
    assert "fatal" not in errors, errors
    ours = json.loads(out.read_text())
    theirs = simple_evaluate(model=HFLM(pretrained=str(files["llama"]), batch_size=4, device="cpu"),
                             tasks=list(TASKS),
                             task_manager=TaskManager(include_path=str(files["tasks"]), include_defaults=False),
                             log_samples=False)
    assert ours["results"] == json.loads(json.dumps(theirs["results"], default=str))
    assert ours["results"]["sounds_mc"]["sample_len"] == DOCS
    # 4 choices per multiple-choice document, one continuation per sounds_next document, one text per sounds_ppl
    assert ours["bigtrain"]["requests"] == {"loglikelihood": 5 * DOCS, "loglikelihood_rolling": DOCS,
                                            "generate_until": DOCS}
    assert ours["bigtrain"]["ranks"] == 1 and ours["bigtrain"]["requests_per_s"] > 0
    assert naming(printed, "sounds_mc", "acc") and naming(printed, "evaluated model directory", str(out))


# -- one line for every mistake -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def every_task(files: dict[str, Path]):
    """lm-eval's own arc and hellaswag task folders with the local one (its whole index of ~15000 task files takes
    ~8 s to read; `bigtrain eval` reads it only when a task is not in the --include-path folders)."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    own = Path(lm_eval.__file__).parent / "tasks"
    return TaskManager(include_path=[str(own / "arc"), str(own / "hellaswag"), str(files["tasks"])],
                       include_defaults=False)


def test_unknown_task_names_the_nearest(every_task) -> None:
    from bigtrain.eval.tasks import load_tasks
    with pytest.raises(ValueError) as err:
        load_tasks(["sounds_mx"], every_task)
    assert naming(str(err.value), "unknown task 'sounds_mx'", "nearest: sounds_mc")
    with pytest.raises(ValueError) as err:
        load_tasks(["helaswag"], every_task)
    assert naming(str(err.value), "'helaswag'", "hellaswag")


def test_a_hub_task_whose_data_is_not_here_is_one_line(every_task) -> None:
    from bigtrain.eval.tasks import load_tasks
    with pytest.raises(ValueError) as err:
        load_tasks(["arc_easy"], every_task)
    line = str(err.value)
    assert len(line.splitlines()) == 1
    assert naming(line, "task arc_easy", "cannot be loaded", "allenai/ai2_arc", "dataset_path: json")


def test_local_task_data_gone_is_one_line_before_any_model_loads(files: dict[str, Path], tmp_path: Path,
                                                                  capsys) -> None:
    pytest.importorskip("lm_eval")
    folder = make_task_folder(tmp_path)
    (folder / "sounds.jsonl").unlink()
    err = _one_line(["eval", str(files["llama"]), "--tasks", "sounds_mc", "--include-path", str(folder)], capsys)
    assert naming(err, "bigtrain eval: task sounds_mc", "cannot be loaded", "sounds.jsonl")
    assert not (files["llama"] / "eval_results.json").exists()


def test_wrong_targets_are_one_line(files: dict[str, Path], tmp_path: Path, capsys) -> None:
    err = _one_line(["eval", str(tmp_path / "nope"), "--tasks", "sounds_mc"], capsys)
    assert naming(err, "nope: no such directory", "run folder", "model directory")
    err = _one_line(["eval", str(tmp_path), "--tasks", "sounds_mc"], capsys)
    assert naming(err, "neither a run folder", "config.json")
    err = _one_line(["eval", str(files["llama"]), "--tasks", "sounds_mc", "--tag", "3"], capsys)
    assert naming(err, "--tag 3", "model directory", "drop --tag")
    err = _one_line(["eval", str(files["llama"]), "--tasks", "sounds_mc", "--zero3"], capsys)
    assert naming(err, "--zero3", "--num-gpus N")


@pytest.mark.parametrize("installed", [None, "0.4.5"])
def test_lm_eval_missing_or_too_old_is_one_line(files: dict[str, Path], monkeypatch, capsys,
                                                installed: str | None) -> None:
    import importlib.metadata

    real = importlib.metadata.version

    def version(name: str) -> str:
        if name == "lm_eval":
            if installed is None:
                raise PackageNotFoundError(name)
            return installed
        return real(name)
    monkeypatch.setattr(importlib.metadata, "version", version)
    err = _one_line(["eval", str(files["llama"]), "--tasks", "sounds_mc"], capsys)
    assert naming(err, "bigtrain eval:", "pip install 'bigtrain[eval]'")
    if installed:
        assert naming(err, "0.4.5", ">= 0.4.10")


# -- during training: config, checks, scores, plot, RNG ------------------------------------------------------------


def test_eval_tasks_config() -> None:
    from bigtrain.config.load import load_run_config
    run = load_run_config(None, ["train.eval_tasks=sounds_mc, sounds_ppl", "train.eval_limit=10"])
    assert run.train.eval_tasks == ["sounds_mc", "sounds_ppl"] and run.train.eval_limit == 10
    assert load_run_config(None, []).train.eval_tasks is None
    with pytest.raises(ValueError, match="train.eval_limit=0"):
        load_run_config(None, ["train.eval_limit=0"])


def test_eval_tasks_refuse_what_they_cannot_run() -> None:
    from bigtrain import models
    from bigtrain.config.load import load_run_config
    from bigtrain.eval.during_training import TaskEvaluator
    run = load_run_config(None, ["train.eval_tasks=sounds_mc", "pipeline.stages=2"])
    gpt2 = models.build("gpt2", "tiny")
    with pytest.raises(ValueError) as err:
        TaskEvaluator.start(run, gpt2, object(), 0, 2)
    assert naming(str(err.value), "pipeline.stages=2", "bigtrain eval")
    with pytest.raises(ValueError) as err:
        TaskEvaluator.start(run, models.build("resnet", "tiny"), None, 0, 1)
    assert naming(str(err.value), "train.eval_tasks", "resnet", "causal language models")
    assert TaskEvaluator.start(load_run_config(None, []), gpt2, object(), 0, 1) is None


def test_scores_and_their_log_line() -> None:
    from bigtrain.eval.runner import score_line, scores
    results = {"results": {"mc": {"alias": "mc", "sample_len": 8, "acc,none": 0.75, "acc_stderr,none": 0.1,
                                  "acc_norm,none": 0.5},
                           "gen": {"exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": "N/A"},
                           "ppl": {"word_perplexity,none": 12.5, "bits_per_byte_stderr,none": "N/A"}}}
    got = scores(results)
    assert got == {"mc": {"acc": 0.75, "acc_norm": 0.5}, "gen": {"exact_match/strict-match": 0.25},
                   "ppl": {"word_perplexity": 12.5}}
    assert score_line(got) == "mc acc 0.75 acc_norm 0.5 | gen exact_match/strict-match 0.25 | ppl word_perplexity 12.5"


def test_loss_plot_gets_a_task_panel(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from PIL import Image

    from bigtrain.metrics.plot import LossCurve, draw
    summary = {"steps": 4, "losses": [4.0, 3.0, 2.5, 2.0], "val_losses": [[2, 3.1], [4, 2.2]],
               "eval_tasks": [[2, {"mc": {"acc": 0.25}, "ppl": {"word_perplexity": 80.0}}],
                              [4, {"mc": {"acc": 0.75}, "ppl": {"word_perplexity": 20.0}}]]}
    curve = LossCurve.from_summary(summary)
    assert curve.tasks == {"mc acc": [(2, 0.25), (4, 0.75)], "ppl word_perplexity": [(2, 80.0), (4, 20.0)]}
    with_tasks = Image.open(draw([curve], tmp_path / "a.png")).size
    without = Image.open(draw([LossCurve.from_summary({**summary, "eval_tasks": []})], tmp_path / "b.png")).size
    assert with_tasks[0] == without[0] and with_tasks[1] > 1.4 * without[1]  # a second panel below


def test_the_runs_random_state_survives_an_evaluation() -> None:
    from bigtrain.eval.during_training import kept_rng
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    with kept_rng():  # lm-eval's simple_evaluate seeds all three
        random.seed(0), np.random.seed(1234), torch.manual_seed(1234)
        torch.rand(3)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_lm_evals_bootstrap_runs_in_this_process_not_a_forked_pool(monkeypatch) -> None:
    """lm-eval bootstraps standard errors in a Pool forked from a process full of torch / gloo threads, where a
    worker can wait on an inherited lock forever (a CI run hung so); `evaluate` switches it to its one-loop path
    for the call (the same seeds, so the same numbers: tests/dist/test_eval_runs.py compares with `lm_eval`'s
    own command, which uses the pool) and leaves the environment as it was."""
    lm_eval = pytest.importorskip("lm_eval")
    from bigtrain.eval.runner import evaluate
    seen = []

    def simple_evaluate(**kwargs):
        seen.append(os.environ.get("DISABLE_MULTIPROC"))
        return None
    monkeypatch.setattr(lm_eval, "simple_evaluate", simple_evaluate)
    monkeypatch.delenv("DISABLE_MULTIPROC", raising=False)

    class Model:
        requests_seen: dict = {}

    class Tasks:
        names, manager = ("a_task",), None
    assert evaluate(Model(), Tasks()) is None
    assert seen == ["1"] and "DISABLE_MULTIPROC" not in os.environ


def test_an_evaluation_during_training_describes_the_environment_once(monkeypatch) -> None:
    """lm-eval's results describe the environment (torch's collect_env, which runs `pip list` and a dozen other
    processes): evaluations in one process, as train.eval_tasks runs them at each interval, ask for it once."""
    lm_eval = pytest.importorskip("lm_eval")
    import lm_eval.evaluator as evaluator
    import torch.utils.collect_env as collect_env
    from bigtrain.eval import runner
    described = []
    monkeypatch.setattr(collect_env, "get_pretty_env_info", lambda: described.append(1) or "the environment")
    monkeypatch.setattr(runner, "_ENVIRONMENT", {})

    def simple_evaluate(**kwargs):
        results = {"results": {}}
        evaluator.add_env_info(results)  # as lm-eval's own simple_evaluate ends
        return results
    monkeypatch.setattr(lm_eval, "simple_evaluate", simple_evaluate)

    class Model:
        requests_seen: dict = {}

    class Tasks:
        names, manager = ("a_task",), None
    first, second = (runner.evaluate(Model(), Tasks()) for _ in range(2))
    assert first["pretty_env_info"] == second["pretty_env_info"] == "the environment" and len(described) == 1
    assert first["lm_eval_version"] == second["lm_eval_version"]
