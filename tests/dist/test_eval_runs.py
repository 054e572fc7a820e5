"""`bigtrain eval` on real 2-rank runs and train.eval_tasks (tests/local_eval.py: a local task folder of what
animals do: a multiple-choice, a loglikelihood, a rolling-perplexity and a generation task).

One launch trains tiny GPT-2s (ZeRO-2 on the tasks' text, ZeRO-2 on other text, ZeRO-3 on the tasks' text), a
LoRA Llama, and a run whose task data is gone, all with train.eval_tasks. Then: `bigtrain eval` on the export, on
the run folder, on 2 ranks and as ZeRO-3 partitions over 2 ranks gives exactly what lm-eval's own `lm_eval --model
hf` command gives on the export; the model trained on the tasks' text scores above the other; the scores logged
during training equal a `bigtrain eval` of the same checkpoint (split over ranks at ZeRO-2, in lockstep at ZeRO-3);
they reach summary.json, the CSV monitor and loss.png; a LoRA run evaluates with its adapters merged, as its
adapter export does.
"""
from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pytest

from launch import BIN, REPO, TINY, launch_jobs, rank_env, summary
from local_eval import TASKS, make_eval_files, make_task_folder
from messages import naming

pytest.importorskip("lm_eval")

from bigtrain import cli  # noqa: E402
from bigtrain.eval.runner import scores  # noqa: E402

BATCH = "4"
STEPS = 40


def task_args(files: dict[str, Path], source: str, steps: int, *extra: str, evals: int = 1) -> list[str]:
    """A run that scores the tasks `evals` times, the last at its last step (its final_eval_tasks): only the run
    whose scores over time a test reads scores them twice; each round is every task on every document."""
    return [*TINY, "--steps", str(steps), "--set", f"data.source={files[source]}",
            "--set", f"data.tokenizer={files['tokenizer']}", "--set", "optimizer.lr=3e-3",
            "--set", f"train.eval_interval={steps // evals}", "--set", f"train.eval_tasks={','.join(TASKS)}",
            "--set", f"train.eval_include_path={files['tasks']}", *extra]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("evaluation")
    files = make_eval_files(root / "files")
    gone = make_task_folder(root / "gone")
    (gone / "sounds.jsonl").unlink()
    lora = ["--model", "hf", "--set", f"model.pretrained={files['llama']}", "--set", "lora.r=4",
            *task_args(files, "sounds", 6, "--set", "zero.stage=2")]
    launch_jobs(root, [
        {"name": "sounds", "args": task_args(files, "sounds", STEPS, "--set", "zero.stage=2", evals=2), "plot": True},
        {"name": "other", "args": task_args(files, "other", STEPS, "--set", "zero.stage=2")},
        {"name": "z3", "args": task_args(files, "sounds", 10, "--set", "zero.stage=3")},
        {"name": "lora", "args": [a for a in lora if a not in ("--size", "tiny")]},
        {"name": "gone", "args": task_args(files, "sounds", 4, "--set", f"train.eval_include_path={gone}"),
         "expect_error": True},
    ], HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    return root


def bigtrain_eval(target: Path, out: Path, tasks: Path, *extra: str) -> dict:
    assert cli.main(["eval", str(target), "--tasks", ",".join(TASKS), "--include-path", str(tasks),
                     "--batch-size", BATCH, "--out", str(out), *extra]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def export(root: Path) -> Path:
    from bigtrain.export import export_checkpoint
    return export_checkpoint(root / "sounds", root / "export").out


@pytest.fixture(scope="module")
def lm_eval_cli(root: Path, export: Path) -> dict:
    """lm-eval's own command on the export: the reference every `bigtrain eval` is held to."""
    out = root / "lm_eval_out"
    proc = subprocess.run([str(BIN / "lm_eval"), "--model", "hf", "--model_args", f"pretrained={export}",
                           "--tasks", ",".join(TASKS), "--include_path", str(root / "files" / "tasks"),
                           "--device", "cpu", "--batch_size", BATCH, "--output_path", str(out)],
                          cwd=root, env=rank_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.rglob("results_*.json")
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def on_run(root: Path) -> dict:
    """`bigtrain eval` on the run folder (ZeRO-2 checkpoint consolidated in memory), in this process."""
    return bigtrain_eval(root / "sounds", root / "on_run.json", root / "files" / "tasks")


def test_bigtrain_eval_equals_lm_evals_command_on_the_export_the_run_and_two_ranks(root: Path, export: Path,
                                                                                    lm_eval_cli: dict,
                                                                                    on_run: dict) -> None:
    tasks = root / "files" / "tasks"
    reference = lm_eval_cli["results"]
    assert set(reference) == set(TASKS) and reference["sounds_mc"]["acc,none"] > 0.5  # a trained model, not chance
    on_export = bigtrain_eval(export, root / "on_export.json", tasks)
    assert on_export["results"] == reference
    assert on_run["results"] == reference
    assert naming(on_run["bigtrain"]["target"], "checkpoint step_000040")
    proc = subprocess.run([str(BIN / "bigtrain"), "eval", str(root / "sounds"), "--tasks", ",".join(TASKS),
                           "--include-path", str(tasks), "--batch-size", BATCH, "--num-gpus", "2",
                           "--out", str(root / "two_ranks.json")], cwd=REPO, env=rank_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    two = json.loads((root / "two_ranks.json").read_text())
    assert two["bigtrain"]["ranks"] == 2 and two["results"] == reference
    assert naming(proc.stdout, "sounds_mc", "acc") and naming(proc.stdout, "with 2 rank(s)", "two_ranks.json")
    # the accelerator is detected once, in `bigtrain eval`, quietly: neither the launcher nor a rank says it
    assert "Setting accelerator" not in proc.stdout + proc.stderr, proc.stderr[-3000:]


def test_zero3_partitions_over_two_ranks_give_lm_evals_numbers(root: Path, lm_eval_cli: dict) -> None:
    """--zero3: 1/2 of every weight per rank, gathered layer by layer in every forward pass (no request split)."""
    proc = subprocess.run([str(BIN / "bigtrain"), "eval", str(root / "sounds"), "--tasks", ",".join(TASKS),
                           "--include-path", str(root / "files" / "tasks"), "--batch-size", BATCH, "--num-gpus", "2",
                           "--zero3", "--out", str(root / "zero3.json")], cwd=REPO, env=rank_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    zero3 = json.loads((root / "zero3.json").read_text())
    assert zero3["bigtrain"]["zero3"] and naming(zero3["bigtrain"]["target"], "ZeRO-3 partitions over 2 ranks")
    assert zero3["results"] == lm_eval_cli["results"]


def test_a_model_trained_on_the_tasks_text_scores_above_one_trained_on_other_text(root: Path) -> None:
    task, other = summary(root / "sounds")["final_eval_tasks"], summary(root / "other")["final_eval_tasks"]
    assert task["sounds_mc"]["acc"] >= other["sounds_mc"]["acc"] + 0.4, (task, other)
    assert task["sounds_next"]["acc"] > other["sounds_next"]["acc"]
    assert task["sounds_next"]["perplexity"] < other["sounds_next"]["perplexity"] / 10
    assert task["sounds_ppl"]["word_perplexity"] < other["sounds_ppl"]["word_perplexity"]


def test_scores_during_training_equal_bigtrain_eval_of_the_checkpoint(root: Path, on_run: dict) -> None:
    """ZeRO-2: the ranks split the requests; ZeRO-3: every rank takes part in every forward pass."""
    assert summary(root / "sounds")["final_eval_tasks"] == scores(on_run)
    z3 = bigtrain_eval(root / "z3", root / "z3_after.json", root / "files" / "tasks")
    assert naming(z3["bigtrain"]["target"], "(zero3)")
    assert summary(root / "z3")["final_eval_tasks"] == scores(z3)


def test_task_scores_reach_the_summary_the_monitor_and_the_plot(root: Path) -> None:
    from PIL import Image
    run = summary(root / "sounds")
    assert [step for step, _ in run["eval_tasks"]] == [STEPS // 2, STEPS]
    first, last = run["eval_tasks"][0][1], run["eval_tasks"][1][1]
    assert last["sounds_mc"]["acc"] > first["sounds_mc"]["acc"] or last["sounds_mc"]["acc"] == 1.0
    (csv_file,) = (root / "sounds" / "csv").rglob("bigtrain_eval_sounds_mc_acc.csv")
    rows = [r for r in csv.reader(csv_file.read_text().splitlines()) if r and r[0] != "step"]
    assert [(int(float(s)), float(v)) for s, v in rows] == [(STEPS // 2, first["sounds_mc"]["acc"]),
                                                            (STEPS, last["sounds_mc"]["acc"])]
    width, height = Image.open(root / "sounds" / "loss.png").size
    assert height > 1.4 * 528  # loss.png's second panel (one panel: 4.8 in x 110 dpi)


def test_a_lora_run_evaluates_merged(root: Path) -> None:
    """The run folder's base + adapters merged in memory (export's own merge) scores what the trained model scored
    during training with its adapters active, up to the merge's rounding."""
    lora = bigtrain_eval(root / "lora", root / "lora_run.json", root / "files" / "tasks")
    assert naming(lora["bigtrain"]["target"], "LoRA r=4 merged")
    during = summary(root / "lora")["final_eval_tasks"]
    assert set(during) == set(TASKS)
    for task, metrics in scores(lora).items():
        assert during[task] == pytest.approx(metrics, rel=1e-4)
    base = bigtrain_eval(root / "files" / "llama", root / "base.json", root / "files" / "tasks", "--tasks",
                         "sounds_ppl")  # the base alone: the adapters' share is far above that tolerance
    assert scores(base)["sounds_ppl"]["word_perplexity"] > 1.05 * during["sounds_ppl"]["word_perplexity"]
    from bigtrain.export import export_checkpoint
    adapter = export_checkpoint(root / "lora", root / "lora_adapter", adapter=True).out  # peft's directory alone
    on_adapter = bigtrain_eval(adapter, root / "on_adapter.json", root / "files" / "tasks")
    assert naming(on_adapter["bigtrain"]["target"], "adapter directory", "merged into its base")
    assert on_adapter["results"] == lora["results"]


def test_task_data_gone_stops_the_run_before_it_trains(root: Path) -> None:
    line = (root / "gone" / "error.txt").read_text()
    assert len(line.splitlines()) == 1 and naming(line, "task sounds_mc", "cannot be loaded", "sounds.jsonl")
    assert not (root / "gone" / "checkpoints").exists() or not any((root / "gone" / "checkpoints").iterdir())
