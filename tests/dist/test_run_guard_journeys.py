"""Nothing silently wrong, the journeys a user takes, followed to their exit through the real
launcher or a plain `python`: a diverging run stops with one line and saves nothing from it, a mistake seen on
rank 0 only is one line, one folder holds one run (a second job, a fresh run on old checkpoints, another
model on --resume, a damaged checkpoint), a full disk during a save is one line (the pieces:
tests/unit/test_run_guards.py). What starts no rank (an export, `bigtrain train` or a plain `python bigtrain/run.py`
refusing before any process group) runs in this process through `bigtrain.cli.main` or `bigtrain.run.main`, what the
command and the script call: no interpreter start and imports of its own."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import REPO, TINY, deepspeed_cmd, rank_env
from messages import error_lines, naming

from bigtrain.checkpoint import store

RUN_PY = REPO / "bigtrain" / "run.py"


def strict_json(path: Path) -> dict:
    def refuse(name: str):
        raise AssertionError(f"{path} holds {name}, which strict JSON parsers reject")
    return json.loads(path.read_text(), parse_constant=refuse)


def python_run(out: Path, *args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RUN_PY), "--out", str(out), *TINY, *args], cwd=REPO, env=rank_env(),
                          capture_output=True, text=True, timeout=300, **kwargs)


def bigtrain(capsys: pytest.CaptureFixture, *args: str) -> subprocess.CompletedProcess:
    """`bigtrain ARGS` in this process: its exit status, and what it printed."""
    from bigtrain import cli
    capsys.readouterr()
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def test_a_diverging_run_stops_with_one_line_and_saves_nothing_from_it(tmp_path, capsys):
    """Step 1 trains at 1e-3, step 2 at 1.25e29: its weights are finite but give a NaN loss at step 3. The job exits 3
    with one line from rank 0 naming the step; step 2's checkpoint, whose weights gave that loss, is set aside,
    and the last good one (step 1) is what resume and export take; the set-aside one does not export."""
    out = tmp_path / "run"
    args = ["--out", str(out), *TINY, "--steps", "8", "--set", "checkpoint.interval=1", "--set", "optimizer.lr=1e30",
            "--set", "schedule.min_lr_ratio=1e-33", "--set", "schedule.warmup_steps=10"]
    proc = subprocess.run(deepspeed_cmd(RUN_PY, args), cwd=REPO, env=rank_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert len(error_lines(proc.stderr)) == 1, proc.stderr[-5000:]
    (line,) = error_lines(proc.stderr)
    ckpt = out / "checkpoints"
    # the step and the loss, that nothing was saved from it, where the suspect checkpoint went, what is kept
    assert line.startswith("bigtrain: ") and naming(line, "diverged", "step 3", "nan", "nothing was saved"), line
    assert naming(line, "set aside", str(ckpt / "step_000002_diverged")), line
    assert naming(line, "last complete checkpoint", str(ckpt / "step_000001")), line
    assert "Traceback" not in proc.stderr and "gone" not in proc.stderr
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_000001", "step_000002_diverged"]
    assert (ckpt / "latest").read_text() == "step_000001"
    summary = strict_json(out / "summary.json")
    assert summary["stopped_by"] == "diverged" and summary["diverged"].startswith("step 3: ")
    assert summary["losses"][2] is None
    export = bigtrain(capsys, "export", str(out), "--out", str(tmp_path / "export"))
    assert export.returncode == 0 and "step_000001" in export.stdout, export.stderr[-2000:]
    checked = [line for line in export.stdout.splitlines() if "logit difference" in line]
    assert checked and checked[0].split()[-1] == "0", export.stdout  # the export's own check: the same logits
    refused = bigtrain(capsys, "export", str(ckpt / "step_000002_diverged"), "--out", str(tmp_path / "e2"))
    assert refused.returncode == 2 and "non-finite logits" in refused.stderr and not (tmp_path / "e2").exists()


def test_a_mistake_seen_on_rank_0_only_is_one_line_and_the_other_ranks_leave_quietly(tmp_path):
    """Rank 0 prepares the data while rank 1 waits: a binary file among the sources is rank 0's to see."""
    data = tmp_path / "corpus"
    data.mkdir()
    (data / "a.txt").write_text("plain text for the tokenizer. " * 400)
    (data / "b.txt").write_bytes(bytes(range(256)) * 64)
    args = ["--out", str(tmp_path / "run"), *TINY, "--steps", "2", "--data", str(data)]
    proc = subprocess.run(deepspeed_cmd(RUN_PY, args), cwd=REPO, env=rank_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    (line,) = error_lines(proc.stderr)
    assert "b.txt" in line
    for noise in ("Traceback", "TCPStore", "gone", "--resume", "rank 1"):
        assert noise not in proc.stderr, proc.stderr[-3000:]


def test_through_bigtrain_train_a_mistake_is_one_line_and_the_launcher_does_not_repeat_it(tmp_path, capsys):
    """A run config that does not load, and --resume with nothing to resume (a mistyped --out), stop before any rank
    starts (their one line and nothing else: the launcher prints its command line first, a rank its log folder); a
    mistake a rank finds (a global batch the world size does not divide) is its one line, without DeepSpeed's
    launcher line that repeats every argument."""
    train = ["train", "--num-gpus", "2"]
    proc = bigtrain(capsys, *train, *TINY, "--set", "lora.rank=8", "--out", str(tmp_path / "typo"))
    assert proc.returncode == 2 and not (tmp_path / "typo").exists(), proc.stderr  # no rank made its folder
    assert proc.stdout == "" and proc.stderr.splitlines() == ["bigtrain: unknown key 'lora.rank': allowed: alpha, "
                                                              "dropout, r, targets, vision_tower"], proc.stderr
    proc = bigtrain(capsys, *train, *TINY, "--steps", "2", "--resume", "--out", str(tmp_path / "nothing"))
    assert proc.returncode == 2 and not (tmp_path / "nothing").exists(), proc.stderr  # no rank made its folder
    (line,) = proc.stderr.splitlines()
    assert proc.stdout == "" and naming(line, "--resume", "no complete checkpoint", "drop --resume"), line
    proc = subprocess.run([str(Path(sys.executable).parent / "bigtrain"), *train, *TINY, "--steps", "2", "--set",
                           "batch.global_batch=3", "--out", str(tmp_path / "batch")], cwd=REPO, env=rank_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    (line,) = error_lines(proc.stderr)
    assert naming(line, "batch.global_batch=3", "not divisible by 2"), line
    for noise in ("sigkill_handler", "return code", "Traceback"):
        assert noise not in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def run_py_here(capsys: pytest.CaptureFixture, out: Path, *args: str) -> subprocess.CompletedProcess:
    """`python bigtrain/run.py --out OUT TINY ARGS` for a run refused before its process group, in this process."""
    from bigtrain.run import main
    capsys.readouterr()
    code = main(["--out", str(out), *TINY, *args])
    printed, said = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, printed, said)


def test_one_folder_one_run(tmp_path, capsys):
    """A second job on a busy folder, a fresh run on an earlier run's checkpoints, a resume with another model and a
    resume past a damaged checkpoint: each refused or handled with one line, and the first run's files intact."""
    out = tmp_path / "run"
    first = subprocess.Popen([sys.executable, str(RUN_PY), "--out", str(out), *TINY, "--steps", "100000",
                              "--set", "checkpoint.interval=2", "--set", "checkpoint.keep_last=3"],
                             cwd=REPO, env=rank_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(list((out / "checkpoints").glob("step_*/bigtrain.json"))) < 2:
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()[-3000:]
            time.sleep(0.5)
        # Paused, the first job still holds the folder (a live process, its lock) without training on one of the two
        # cores all the while the second is refused; the kill below ends it as it would a running one.
        os.kill(first.pid, signal.SIGSTOP)
        second = run_py_here(capsys, out, "--steps", "4")
        lines = error_lines(second.stderr)  # one line: the folder, that it is busy, and by which process where
        assert second.returncode == 2 and len(lines) == 1, second.stderr[-3000:]
        assert naming(lines, str(out), "in use", f"pid {first.pid}", os.uname().nodename), lines
        assert "another --out" in second.stderr
    finally:
        first.kill()  # kill -9: the kernel drops its lock
        first.wait()
    tags = sorted((out / "checkpoints").glob("step_*/bigtrain.json"))
    newest = tags[-1].parent
    fresh = run_py_here(capsys, out, "--steps", "4")
    assert fresh.returncode == 2 and naming(fresh.stderr, "earlier run", newest.name), fresh.stderr[-3000:]
    assert "--overwrite" in fresh.stderr and len(error_lines(fresh.stderr)) == 1
    other_model = python_run(out, "--steps", "100000", "--resume", "--set", "model.overrides.n_head=4")
    assert other_model.returncode == 2, other_model.stderr[-2000:]
    (line,) = error_lines(other_model.stderr)  # the checkpoint, what differs, and the ways on
    assert naming(line, "--resume", str(newest), "another model", "n_head 2 -> 4"), line
    assert naming(line, "another --out", "--overwrite"), line
    optimizer_file = next(newest.glob("*optim_states.pt"))
    with optimizer_file.open("r+b") as f:
        f.seek(optimizer_file.stat().st_size // 2)
        f.write(os.urandom(4096))
    step = int(newest.name.split("_")[1])
    resumed = python_run(out, "--steps", str(step + 1), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = resumed.stdout + resumed.stderr
    assert naming(log, "skipping checkpoint", str(newest), optimizer_file.name, "changed"), log[-3000:]
    assert naming(log, "resumed from", str(tags[-2].parent), f"step {step - 2}"), log[-3000:]


def test_a_full_disk_during_a_save_is_one_line_and_the_last_checkpoint_stays(tmp_path):
    disk = tmp_path / "small_disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("no permission to mount a small tmpfs here")
    try:
        ckpt = disk / "ckpt"
        args = ["--out", str(tmp_path / "run"), *TINY, "--steps", "8", "--set", "checkpoint.interval=2",
                "--set", f"checkpoint.dir={ckpt}"]
        proc = subprocess.run(deepspeed_cmd(RUN_PY, args), cwd=REPO, env=rank_env(), capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 2, proc.stderr[-3000:]
        lines = error_lines(proc.stderr)
        assert len(lines) == 1, proc.stderr[-5000:]
        (line,) = lines
        assert naming(line, str(ckpt), "full") and "Traceback" not in proc.stderr, line
        kept = store.find_resumable(ckpt)[0]
        assert naming(line, "last complete checkpoint", str(ckpt / kept), "kept"), line
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_a_sigterm_to_bigtrain_train_saves_and_it_returns_only_after_its_ranks(tmp_path):
    """What slurm's scancel or a container stop does: SIGTERM to `bigtrain train`. The ranks save and stop; it
    returned while they still ran (a --resume at its return raced them) and exited 241; now the launcher is not
    signalled (it would SIGKILL a long save after 30 s), it returns after the last rank, and exits 143."""
    import psutil
    out = tmp_path / "run"
    proc = subprocess.Popen([str(Path(sys.executable).parent / "bigtrain"), "train", "--num-gpus", "2", *TINY,
                             "--steps", "400", "--set", "logging.interval=1", "--set", "train.eval_interval=0",
                             "--out", str(out)], cwd=REPO, env=rank_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    deadline = time.time() + 180
    for line in proc.stdout:  # training is under way
        lines.append(line)
        if line.startswith("step 3/400") or time.time() > deadline:
            break
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=180)
    log = "".join(lines) + rest
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])]
    assert proc.returncode == 128 + signal.SIGTERM and not left, (proc.returncode, left, log[-3000:])
    saved = strict_json(out / "summary.json")
    assert saved["stopped_by"] == "SIGTERM" and 3 <= saved["steps"] < 400, log[-3000:]
    assert store.check_complete(out / "checkpoints" / f"step_{saved['steps']:06d}") is None
    assert "Traceback" not in log and "sigkill_handler" not in log, log[-3000:]
