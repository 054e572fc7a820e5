"""`bigtrain preflight`: the strict hostfile parser, the host check, and the world-size / batch / memory report."""
from __future__ import annotations

import argparse
import re
import shutil
import time

import pytest

from bigtrain.config.load import load_run_config
from bigtrain.estimate.memory_model import estimate, setup_from_run
from bigtrain.estimate.shape import shape_from_spec
from bigtrain.models import build
from bigtrain.launch.hosts import HostEntry, HostfileError, read_hostfile, world_size
from bigtrain.launch.preflight import add_preflight_parser, check_host, check_hosts, run_preflight
from bigtrain.train.inputs import overrides_for_run
from launch import REPO
from messages import naming

TINY = ["--set", "model.size=tiny", "--set", "data.vocab_size=512", "--set", "data.seq_len=64",
        "--set", "precision=bf16"]


def hostfile(tmp_path, text: str):
    path = tmp_path / "hostfile"
    path.write_text(text)
    return path


def problems_of(path) -> list[str]:
    with pytest.raises(HostfileError) as info:
        read_hostfile(path)
    return info.value.problems


def test_hostfile_with_comments_blank_lines_and_trailing_comments(tmp_path):
    path = hostfile(tmp_path, "# two nodes\n\nworker-1 slots=8\n   worker-2   slots=4   # the small one\n")
    entries = read_hostfile(path)
    assert entries == [HostEntry("worker-1", 8, 3), HostEntry("worker-2", 4, 4)]
    assert world_size(entries) == 12
    assert world_size(entries, gpus_per_node=2) == 4  # deepspeed --num_gpus 2 takes 2 slots per host
    assert world_size(entries, gpus_per_node=6) == 10


def test_the_example_hostfile_parses():
    entries = read_hostfile(REPO / "hostfile.example")
    assert [e.host for e in entries] == ["worker-1", "worker-2"] and world_size(entries) == 16


def test_missing_hostfile_is_an_error_not_a_local_run(tmp_path):
    (problem,) = problems_of(tmp_path / "nope")
    assert "nope does not exist" in problem and "silently train on this machine" in problem


@pytest.mark.parametrize("line, expected", [
    ("worker-1", r"'worker-1': expected 'HOSTNAME slots=N'"),
    ("worker-1 slots 8", r"expected 'HOSTNAME slots=N'"),
    ("slots=8 worker-1", r"expected 'HOSTNAME slots=N'"),  # what follows slots=N is DeepSpeed's to ignore
    ("worker-1 slot=8", r"expected 'HOSTNAME slots=N'"),
    ("worker-1 slots=0", r"slots=0 for worker-1: slots must be a positive integer"),
    ("worker-1 slots=-2", r"slots=-2 for worker-1: slots must be a positive integer"),
    ("worker-1 slots=x", r"slots=x for worker-1: slots must be a positive integer"),
    ("worker-1 slots=", r"slots= for worker-1: slots must be a positive integer"),
])
def test_each_bad_line_is_named(tmp_path, line, expected):
    path = hostfile(tmp_path, f"# header\n{line}\n")
    (problem,) = problems_of(path)
    assert problem.startswith(f"{path}:2: ") and re.search(expected, problem), problem


def test_duplicate_host_names_both_lines(tmp_path):
    path = hostfile(tmp_path, "worker-1 slots=8\nworker-2 slots=8\n\nworker-1 slots=4\n")
    (problem,) = problems_of(path)
    assert "worker-1" in problem and "twice" in problem and "lines 1 and 4" in problem, problem


def test_every_problem_is_reported_at_once(tmp_path):
    path = hostfile(tmp_path, "a slots=1\nb\nc slots=0\na slots=2\n")
    problems = problems_of(path)
    assert [p.split(": ")[0] for p in problems] == [f"{path}:2", f"{path}:3", f"{path}:4"]


@pytest.mark.parametrize("text", ["", "# only a comment\n\n"])
def test_a_hostfile_without_hosts_is_an_error(tmp_path, text):
    (problem,) = problems_of(hostfile(tmp_path, text))
    assert "lists no hosts" in problem


def test_unresolvable_host_fails_fast_with_a_clear_message():
    start = time.monotonic()
    problem = check_host(HostEntry("no-such-node.invalid", 8, 3), timeout=2)
    assert time.monotonic() - start < 5
    assert naming(problem, "no-such-node.invalid", "line 3", "resolve"), problem


def test_no_ssh_contacts_nobody_and_local_names_are_not_sshed():
    entries = [HostEntry("no-such-node.invalid", 1, 1), HostEntry("localhost", 1, 2)]
    assert check_hosts(entries, "no_ssh") == []
    problems = check_hosts([HostEntry("localhost", 1, 1), HostEntry("127.0.0.1", 1, 2)], "ssh")
    if shutil.which("ssh"):
        assert problems == []
    else:
        assert len(problems) == 1 and naming(problems, "ssh", "not installed", "--launcher no_ssh"), problems


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bigtrain")
    add_preflight_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["preflight", *argv])


def test_world_size_batch_triple_and_memory_are_printed(tmp_path, capsys):
    path = hostfile(tmp_path, "localhost slots=2\n127.0.0.1 slots=2\n")
    code = run_preflight(parse(["--hostfile", str(path), "--launcher", "no_ssh", *TINY,
                                "--set", "batch.global_batch=32", "--set", "batch.micro_batch=2"]))
    out, err = capsys.readouterr()
    assert code == 0, err
    assert naming(out, f"hostfile {path}", "2 host(s)", "world size 4", "(2 + 2)"), out
    assert naming(out, "batch: ", "train_batch_size 32", "micro 2", "accum 4", "data-parallel 4"), out
    run = load_run_config(None, ["model.size=tiny", "data.vocab_size=512", "data.seq_len=64", "precision=bf16",
                                 "batch.global_batch=32", "batch.micro_batch=2"])
    spec = build("gpt2", "tiny", **overrides_for_run(run, None, "cuda"))  # the run's model, from its config alone
    assert spec.num_params == build("gpt2", "tiny", vocab_size=512, seq_len=64, n_positions=128).num_params
    expected = estimate(shape_from_spec(spec, "bf16"), setup_from_run(run, 4, 2)).device_peak / 2**30
    assert naming(out, "memory per rank", "zero1", "bf16", "micro-batch 2", f"{expected:.2f} GiB"), out
    assert err.strip().endswith("preflight: OK")


def test_a_deepspeed_json_is_fitted_to_the_hostfile_world_size(tmp_path, capsys):
    path = hostfile(tmp_path, "localhost slots=1\n127.0.0.1 slots=1\n")
    code = run_preflight(parse(["--hostfile", str(path), "--launcher", "no_ssh", *TINY,
                                "--deepspeed_config", str(REPO / "ds_configs" / "zero2.json")]))
    out, err = capsys.readouterr()
    assert code == 0, err
    # zero2.json says 32 = 4 x 1 x 8; on 2 ranks the global batch is kept with more accumulation
    assert naming(out, "batch: ", "train_batch_size 32", "micro 4", "accum 4", "data-parallel 2"), out
    assert naming(out, "note: batch triple", "data-parallel size 2", "was 8"), out


def test_every_problem_is_one_line_and_exit_2(tmp_path, capsys):
    path = hostfile(tmp_path, "localhost slots=3\n127.0.0.1 slots=3\n")
    code = run_preflight(parse(["--hostfile", str(path), "--launcher", "no_ssh", *TINY,
                                "--set", "batch.global_batch=8", "--set", "batch.micro_batch=4"]))
    _, err = capsys.readouterr()
    assert code == 2
    assert naming(err, "bigtrain preflight: ", "batch.global_batch=8", "divisible", "24"), err
    code = run_preflight(parse(["--hostfile", str(path), "--launcher", "no_ssh", "--set", "model.size=small",
                                "--gpu-mem", "256MiB"]))
    _, err = capsys.readouterr()
    assert code == 2
    (line,) = [l for l in err.splitlines() if l.startswith("bigtrain preflight:")]
    assert re.search(r"[0-9.]+ GiB per rank", line) and "--gpu-mem 0.2 GiB" in line and "10% headroom" in line, line
    code = run_preflight(parse(["--hostfile", str(tmp_path / "missing")]))
    _, err = capsys.readouterr()
    assert code == 2 and "missing does not exist" in err


def test_module_entry_takes_both_flag_spellings(tmp_path, capsys):
    """`python -m bigtrain.launch.preflight` (the slurm script's call) parses flags as `bigtrain preflight` does."""
    from bigtrain.launch.preflight import main
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    for flag in ("--gpus_per_node", "--gpus-per-node"):
        assert main(["--hostfile", str(hostfile), "--launcher", "no_ssh", flag, "2", "--size", "tiny"]) == 0
        assert "data-parallel 2" in capsys.readouterr().out
