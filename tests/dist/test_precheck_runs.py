"""`bigtrain train` says a mistake that needs no rank before its launcher starts: a record without
`rejected`, a pair objective on plain text, pairs whose answers are all the same, an --out that holds another run, a
model directory of another family, an unknown evaluation task, conversations and a tokenizer without a chat template,
and `bigtrain eval --num-gpus 2` with an unknown task. Each is one line and exit 2, no launcher started (its command
line is printed as it starts), no rank log, for less than half the CPU seconds of the one good launch of this file
(one rank, one step: which also leaves the run folder the --out case reuses).

The refusals run the verbs in this process (`bigtrain.cli.main`, what the `bigtrain` command calls), where a broken
check would go on to start the launcher as the command does; the good launch is the command itself. CPU seconds, not
wall time: a loaded machine slows a refusal and a launch measured minutes apart by different factors.
"""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest

from budget import cpu_seconds
from launch import BIN, REPO, rank_env
from local_chat import make_chat_tokenizer, preference_pairs, write_jsonl
from messages import naming

SMALL = ["--set", "data.seq_len=64", "--set", "precision=fp32", "--set", "logging.progress_bar=false",
         "--set", "train.sample_tokens=0", "--steps", "1"]


class Refused(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def bigtrain(capsys: pytest.CaptureFixture, *argv: str) -> tuple[Refused, float]:
    """`bigtrain ARGV` in this process: what it printed and returned, and the CPU seconds it took (this process's
    and any it started)."""
    from bigtrain import cli
    capsys.readouterr()
    start = cpu_seconds()
    code = cli.main(list(argv))
    spent = cpu_seconds() - start
    out, err = capsys.readouterr()
    return Refused(code, out, err), spent


def bigtrain_train(capsys: pytest.CaptureFixture, args: list[str]) -> tuple[Refused, float]:
    return bigtrain(capsys, "train", "--num-gpus", "2", *args)


def rank_logs(out: Path) -> dict[str, int]:
    """The rank logs in OUT/logs, with their modification times (a rank that started writes its own)."""
    return {p.name: p.stat().st_mtime_ns for p in (out / "logs").glob("rank*")} if (out / "logs").is_dir() else {}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A Llama with a chat tokenizer, a GPT-2 whose tokenizer has no chat template, and preference records."""
    import torch
    from local_hf import decoder_config
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel
    root = tmp_path_factory.mktemp("precheck_runs")
    tok = make_chat_tokenizer(root / "llama")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(decoder_config("llama", len(tok))).save_pretrained(root / "llama")
    tok.chat_template = None
    tok.save_pretrained(str(root / "gpt2"))
    (root / "gpt2" / "chat_template.jinja").unlink(missing_ok=True)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=128,
                               bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)).save_pretrained(root / "gpt2")
    pairs = preference_pairs(40)
    write_jsonl(root / "pairs.jsonl", pairs)
    write_jsonl(root / "no_rejected.jsonl", [{k: v for k, v in r.items() if k != "rejected"} for r in pairs])
    write_jsonl(root / "same.jsonl", [dict(r, rejected=r["chosen"]) for r in pairs])
    (root / "plain.txt").write_text("the cat sat on the mat and we ask what is two plus two\n" * 200)
    return root


def dpo(root: Path, data: str, out: str, model: str = "llama", *extra: str) -> list[str]:
    return ["--model", "hf", "--set", f"model.pretrained={root / model}", "--data", str(root / data),
            "--set", "objective.kind=dpo", "--out", str(root / out), *SMALL, *extra]


@pytest.fixture(scope="module")
def launch_cpu(root: Path) -> float:
    """The CPU seconds of one good launch through the command, as short as one can be (one rank, one step of the
    Llama on plain text), which leaves root/done holding a run's checkpoints."""
    start = cpu_seconds()
    proc = subprocess.run([str(BIN / "bigtrain"), "train", "--num-gpus", "1", "--model", "hf", "--set",
                           f"model.pretrained={root / 'llama'}", "--data", str(root / "plain.txt"), "--out",
                           str(root / "done"), *SMALL], cwd=REPO, env=rank_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (root / "done" / "checkpoints").is_dir() and naming(proc.stderr, "+ ", "-m bigtrain.run")  # no launcher
    return cpu_seconds() - start


def stopped_before_any_rank(proc: Refused, seconds: float, launch_cpu: float, out: Path,
                            logs_before: dict[str, int] | None = None) -> str:
    """The one line, after checking that no launcher started and no rank wrote its log, for less than half a
    launch's CPU seconds."""
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not any(line.startswith("+ ") for line in proc.stderr.splitlines()), "the launcher was started"
    assert rank_logs(out) == (logs_before or {}), "a rank wrote its log"
    assert seconds < launch_cpu / 2, (seconds, launch_cpu)
    print(f"{out.name}: {seconds:.1f} CPU s, a good launch {launch_cpu:.1f} CPU s")
    return proc.stderr.strip().splitlines()[-1]


def test_a_record_without_rejected(root: Path, launch_cpu: float, capsys) -> None:
    proc, s = bigtrain_train(capsys, dpo(root, "no_rejected.jsonl", "a"))
    line = stopped_before_any_rank(proc, s, launch_cpu, root / "a")
    assert naming(line, "bigtrain:", "objective.kind=dpo", "no 'rejected'", "['chosen', 'prompt']")
    # with data.format=preference, the reader's own line names 'rejected' alone (tests/unit/test_precheck.py)


def test_a_pair_objective_on_plain_text(root: Path, launch_cpu: float, capsys) -> None:
    proc, s = bigtrain_train(capsys, dpo(root, "plain.txt", "b"))
    line = stopped_before_any_rank(proc, s, launch_cpu, root / "b")
    assert naming(line, "objective.kind=dpo", "plain text", "objective.kind=lm")


def test_chosen_equal_to_rejected_everywhere(root: Path, launch_cpu: float, capsys) -> None:
    proc, s = bigtrain_train(capsys, dpo(root, "same.jsonl", "c"))
    line = stopped_before_any_rank(proc, s, launch_cpu, root / "c")
    assert naming(line, "same.jsonl", "0 of 40 preference pairs", "the same tokens")


def test_an_out_that_holds_another_run(root: Path, launch_cpu: float, capsys) -> None:
    """(an --out another job holds: the same look, tests/unit/test_precheck.py)"""
    logs = rank_logs(root / "done")
    assert logs  # the good launch's
    proc, s = bigtrain_train(capsys, dpo(root, "pairs.jsonl", "done"))
    line = stopped_before_any_rank(proc, s, launch_cpu, root / "done", logs)
    assert naming(line, str(root / "done" / "checkpoints"), "earlier run", "--resume", "--overwrite")


def test_a_directory_of_another_model_family(root: Path, launch_cpu: float, capsys) -> None:
    args = dpo(root, "pairs.jsonl", "e")
    args[1] = "gpt2"  # --model gpt2 on a Llama directory
    proc, s = bigtrain_train(capsys, args)
    line = stopped_before_any_rank(proc, s, launch_cpu, root / "e")
    assert naming(line, str(root / "llama"), "'llama'", "--model gpt2", "--model llama")


def test_an_unknown_evaluation_task(root: Path, launch_cpu: float, capsys) -> None:
    pytest.importorskip("lm_eval")
    proc, s = bigtrain_train(capsys, dpo(root, "pairs.jsonl", "f", "llama", "--set", "train.eval_tasks=hellaswagg"))
    line = stopped_before_any_rank(proc, s, launch_cpu, root / "f")
    assert naming(line, "unknown task 'hellaswagg'", "nearest: hellaswag", "train.eval_include_path")
    assert "--include-path" not in line


def test_chat_pairs_and_a_tokenizer_without_a_chat_template(root: Path, launch_cpu: float, capsys) -> None:
    proc, s = bigtrain_train(capsys, dpo(root, "pairs.jsonl", "g", "gpt2"))
    line = stopped_before_any_rank(proc, s, launch_cpu, root / "g")
    assert naming(line, "no chat template", "data.chat_template=FILE", str(root / "gpt2"))
    assert "Cannot use chat template functions" not in proc.stderr  # transformers' own text


def test_bigtrain_eval_on_ranks_says_an_unknown_task_before_its_launcher(root: Path, launch_cpu: float, capsys) -> None:
    pytest.importorskip("lm_eval")
    (root / "tasks").mkdir(exist_ok=True)
    (root / "tasks" / "sounds_mc.yaml").write_text("task: sounds_mc\ndataset_path: json\n")
    proc, s = bigtrain(capsys, "eval", str(root / "llama"), "--tasks", "sounds_mx", "--include-path",
                       str(root / "tasks"), "--num-gpus", "2")
    line = stopped_before_any_rank(proc, s, launch_cpu, root / "eval")
    assert naming(line, "bigtrain eval:", "unknown task 'sounds_mx'", "nearest: sounds_mc", "--include-path")
