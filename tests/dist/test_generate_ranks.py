"""`bigtrain generate --zero3` and `bigtrain chat --zero3` on 2 ranks (a model held as ZeRO-3 partitions, as
`bigtrain eval --zero3` holds it): greedy output equal to one process's, and a chat driven through stdin whose lines
rank 0 reads and hands the other rank through the store. One process's side: tests/unit/test_generate.py.

The one process each is held to runs in this process (`bigtrain.cli.main`, what the command calls): its output is the
verb's own, without a second interpreter's start and imports; the ranks go through the command and its launcher."""
from __future__ import annotations

import io
import subprocess
from pathlib import Path

import pytest
import torch

from launch import BIN, REPO, rank_env
from local_chat import make_chat_tokenizer

FLAGS = ["--max-new-tokens", "10", "--do-sample", "false"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM

    from local_hf import decoder_config
    root = tmp_path_factory.mktemp("zero3_generate") / "tiny"
    tok = make_chat_tokenizer(root)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(decoder_config("llama", len(tok))).save_pretrained(root)
    return root


def bigtrain(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**rank_env(), "PYTHONPATH": str(REPO)}
    return subprocess.run([str(BIN / "bigtrain"), *args], input=stdin, env=env, capture_output=True, text=True,
                          timeout=400)


def in_process(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, *args: str,
               stdin: str = "") -> subprocess.CompletedProcess:
    """`bigtrain ARGS` in one process, here: its exit status, and what it printed."""
    from bigtrain import cli
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    capsys.readouterr()
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def test_generate_over_zero3_partitions_equals_one_process(model_dir, tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("what is two plus two\ntell me about rivers\n")
    alone = in_process(capsys, monkeypatch, "generate", str(model_dir), "--prompts-file", str(prompts), *FLAGS)
    ranks = bigtrain("generate", str(model_dir), "--prompts-file", str(prompts), *FLAGS, "--zero3", "--num-gpus", "2",
                     "--out", str(tmp_path / "out.jsonl"))
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    assert ranks.stdout == alone.stdout and ranks.stdout.count("=== ") == 2
    assert "as ZeRO-3 partitions over 2 ranks" in ranks.stderr
    assert (tmp_path / "out.jsonl").read_text().count("\n") == 2


def test_chat_over_zero3_partitions_reads_the_terminal_on_rank_0(model_dir, capsys, monkeypatch):
    lines = "hello there\nwhat is two plus two\n/reset\nhello there\n"
    alone = in_process(capsys, monkeypatch, "chat", str(model_dir), *FLAGS, stdin=lines)
    ranks = bigtrain("chat", str(model_dir), *FLAGS, "--zero3", "--num-gpus", "2", stdin=lines)
    assert alone.returncode == 0 and ranks.returncode == 0, ranks.stderr[-3000:]
    assert ranks.stdout == alone.stdout and len(alone.stdout.splitlines()) >= 3
    answers = alone.stdout.splitlines()
    assert answers[0] == answers[-1] != answers[1]  # the second turn saw the first; /reset forgot it
