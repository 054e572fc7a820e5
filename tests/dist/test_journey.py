"""A user's journey through the real launcher: every shipped config that runs on a CPU, with a local
text file, a tokenizer and the end-of-run sample on, runs to its exit within a bound and prints its
sample; ZeRO-3 with the encoder and ResNet too. A run that trains and never exits fails here (the
ZeRO-3 sample once hung both ranks forever). Also: a DeepSpeed JSON without an optimizer trains;
the precedence between the JSON, --config and --set is printed field by field; a resume keeps the
checkpoint's global batch and says so; a stop request reaches a rank waiting inside a collective, and a
rank stops when its launcher is gone (a bounded end-of-run step without ranks: tests/unit/test_lifeline.py).

Launcher start-ups are shared: one launch is the user's own command through DeepSpeed's launcher (ZeRO-3, GPT-2,
text, sample), one runs the other jobs one after another through torchrun (tests/dist_scripts/journey_runs.py: the
configs, not the launcher, are what it tests; ~5 s less than DeepSpeed's launcher).
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from launch import REPO, deepspeed_cmd, free_port, rank_env, summary, torchrun_cmd
from messages import naming

SHIPPED = REPO / "ds_configs"
BOUND_S = 240  # a journey launch that has not exited by then has hung
SAMPLE = "--- sample from the trained model ---"
FAST = ["--peak-tflops", "1", "--steps", "2", "--set", "logging.progress_bar=false",
        "--set", "train.eval_batches=1", "--set", "train.sample_tokens=8"]
TEXT = ["--model", "gpt2", "--size", "tiny", "--set", "data.seq_len=64", "--set", "data.vocab_size=512",
        "--set", "data.num_proc=1", "--set", "batch.grad_accum=1"]


def write_corpus(path: Path) -> Path:
    subjects = ["The model", "A rank", "The optimizer", "Each stage", "The checkpoint", "DeepSpeed"]
    verbs = ["saves", "loads", "shards", "gathers", "updates", "reduces"]
    objects = ["the gradients.", "its parameters.", "the optimizer state.", "a new batch.", "the loss."]
    lines = [f"{s} {v} {o}" for s in subjects for v in verbs for o in objects]
    path.write_text("\n".join(lines * 3) + "\n")
    return path


def launch(script: Path, args: list[str], cmd: Callable[[Path, list[str]], list[str]] = deepspeed_cmd) -> \
        tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd(script, args), cwd=REPO, env=rank_env(), capture_output=True, text=True,
                              timeout=BOUND_S, start_new_session=True)
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        raise AssertionError(f"the launch did not exit within {BOUND_S} s (a hang):\n{out[-4000:]}") from None
    return proc, time.monotonic() - start


def sample_of(log: str) -> str:
    """The generated text printed after the marker (the prompt is "The ")."""
    assert SAMPLE in log, log[-3000:]
    text = log.split(SAMPLE, 1)[1].lstrip("\n").split("\n-----", 1)[0]
    assert text.startswith("The") and len(text) > len("The "), text
    return text


def test_zero3_run_on_text_exits_with_its_sample_and_says_which_setting_won(tmp_path):
    """The README's command with ds_configs/zero3.json, as a user runs it, plus a --config file and a --set; the
    start line says the rate (the file's "auto" leaves it to the run config: here the --config file's)."""
    corpus = write_corpus(tmp_path / "corpus.txt")
    yaml = tmp_path / "run.yaml"
    yaml.write_text("optimizer:\n  lr: 0.0003\n  eps: 1.0e-7\ndata:\n  seq_len: 64\n  vocab_size: 512\n"
                    "  num_proc: 1\n")
    out = tmp_path / "zero3"
    proc, seconds = launch(REPO / "bigtrain" / "run.py", [
        "--model", "gpt2", "--size", "tiny", "--data", str(corpus), "--deepspeed_config", str(SHIPPED / "zero3.json"),
        "--config", str(yaml), "--set", "optimizer.grad_clip=0.5", "--out", str(out), *FAST])
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    print(f"\nZeRO-3 GPT-2 run with the sample: exit 0 after {seconds:.1f} s")
    sample_of(proc.stdout)
    # one line per field: what each source gives, and which wins
    assert naming(log, "precedence: optimizer.eps:", "JSON gives 1e-08", "--config 1e-07", "JSON wins"), log[-5000:]
    assert naming(log, "precedence: optimizer.grad_clip:", "--set gives 0.5", "JSON 1.0", "--set wins"), log[-5000:]
    assert naming(log, "adamw: lr 0.0003 (your config file); weight decay 0.1, betas (0.9, 0.95), 2 warm-up steps "
                  "(the pretraining defaults: no model.pretrained, random weights;"), log[-5000:]
    s = summary(out)
    assert s["steps"] == 2 and all(l == l for l in s["losses"])  # finite, not NaN
    assert s["run_config"]["optimizer"]["lr"] == 0.0003 and s["run_config"]["optimizer"]["grad_clip"] == 0.5
    assert s["ds_config"]["optimizer"]["params"]["lr"] == 0.0003 and s["run_config"]["optimizer"]["eps"] == 1e-8
    assert s["ds_config"]["gradient_clipping"] == 0.5 and s["ds_config"]["zero_optimization"]["stage"] == 3
    assert s["run_config"]["zero"]["stage"] == 3 and s["run_config"]["precision"] == "bf16"


def journey_plan(root: Path, corpus: Path) -> list[dict]:
    tokenizer = ["--set", f"data.tokenizer={root / 'zero0' / 'tokenizer'}"]
    gpt2 = [*TEXT, "--data", str(corpus), *FAST]
    no_optimizer = root / "no_optimizer.json"
    no_optimizer.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}))
    saved, resumed = root / "batch_saved.json", root / "batch_resumed.json"
    zero = {"stage": 2, "reduce_bucket_size": 123, "offload_optimizer": {"device": "cpu", "pin_memory": False}}
    saved.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                                 "zero_optimization": zero}))
    resumed.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                                   "zero_optimization": zero}))
    plain = gpt2[:gpt2.index("batch.grad_accum=1") - 1] + gpt2[gpt2.index("batch.grad_accum=1") + 1:]  # the JSON's
    jobs = [{"name": "zero0", "args": [*gpt2, "--deepspeed_config", str(SHIPPED / "zero0.json")]}]
    for name in ("zero1", "zero2", "zero2_offload", "zero3_offload"):
        jobs.append({"name": name, "args": [*gpt2, *tokenizer, "--deepspeed_config", str(SHIPPED / f"{name}.json")]})
    jobs += [
        {"name": "no_optimizer", "args": [*plain, *tokenizer, "--deepspeed_config", str(no_optimizer)]},
        {"name": "batch_saved", "args": [*plain, *tokenizer, "--deepspeed_config", str(saved)]},
        {"name": "batch_resumed", "copy_from": "batch_saved",
         "args": [*plain, *tokenizer, "--deepspeed_config", str(resumed), "--resume", "--steps", "3"]},
        {"name": "encoder_zero3", "args": ["--model", "encoder", "--size", "tiny", "--data", "synthetic",
                                           "--set", "data.seq_len=32", "--set", "data.synthetic_samples=256",
                                           "--set", "batch.grad_accum=1", *FAST,
                                           "--deepspeed_config", str(SHIPPED / "zero3.json")]},
        {"name": "resnet_zero3", "args": ["--model", "resnet", "--size", "tiny", "--data", "synthetic",
                                          "--set", "data.synthetic_samples=256", "--set", "batch.grad_accum=1",
                                          *FAST, "--deepspeed_config", str(SHIPPED / "zero3.json")]},
        {"name": "pipeline", "args": [*gpt2, *tokenizer, "--deepspeed_config", str(SHIPPED / "pipeline.json")]},
    ]
    return jobs


def job_logs(stdout: str) -> dict[str, tuple[int, str]]:
    """Job name -> (its exit code, the log between its markers)."""
    found = {}
    for match in re.finditer(r"^=== job (\S+) ===\n(.*?)^=== job \1 exit (\d+) \([\d.]+ s\) ===$", stdout, re.S | re.M):
        found[match.group(1)] = (int(match.group(3)), match.group(2))
    return found


def test_every_shipped_cpu_config_runs_to_its_end(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt")
    plan_path = tmp_path / "plan.json"
    jobs = journey_plan(tmp_path, corpus)
    plan_path.write_text(json.dumps(jobs))
    proc, seconds = launch(REPO / "tests" / "dist_scripts" / "journey_runs.py", [str(tmp_path), str(plan_path)],
                           torchrun_cmd)
    (tmp_path / "journey.log").write_text(proc.stdout + proc.stderr)
    print(f"\n{len(jobs)} journey jobs in one launch: exit {proc.returncode} after {seconds:.1f} s")
    logs = job_logs(proc.stdout)
    assert proc.returncode == 0 and set(logs) == {j["name"] for j in jobs}, (proc.stdout + proc.stderr)[-6000:]
    for name, (code, log) in logs.items():
        assert code == 0, f"{name}:\n{log[-4000:]}"
        s = summary(tmp_path / name)
        assert s["steps"] == (3 if name == "batch_resumed" else 2) and all(l == l for l in s["losses"]), name
        if name.startswith(("encoder", "resnet")):
            assert SAMPLE not in log
        else:
            sample_of(log)  # GPT-2, the pipeline included

    # A JSON without an optimizer gets the run config's, named in one line each, and trains.
    log = logs["no_optimizer"][1]
    assert naming(log, "filled from the run config", "no optimizer", '{"type": "AdamW"'), log[-3000:]
    assert naming(log, "filled from the run config", "no scheduler"), log[-3000:]
    ran = summary(tmp_path / "no_optimizer")["ds_config"]
    assert ran["optimizer"]["type"] == "AdamW" and ran["zero_optimization"] == {"stage": 2}

    # What ran is what is recorded: pin_memory false and reduce_bucket_size 123, in summary and checkpoint.
    saved = summary(tmp_path / "batch_saved")
    marker = json.loads((tmp_path / "batch_saved" / "checkpoints" / "step_000002" / "bigtrain.json").read_text())
    for record in (saved, marker):
        assert record["run_config"]["offload"] == {**record["run_config"]["offload"], "optimizer": "cpu",
                                                   "pin_memory": False}
        assert record["run_config"]["zero"]["reduce_bucket_size"] == 123
        assert record["ds_config"]["zero_optimization"]["reduce_bucket_size"] == 123
    assert saved["ds_config"]["train_batch_size"] == 8

    # The resume keeps the checkpoint's global batch (8) with the new JSON's micro-batch 1: accumulation 4.
    log = logs["batch_resumed"][1]
    assert naming(log, "global batch", "checkpoint trained with 8", "8 (kept)", "train_batch_size 8", "micro 1",
                  "accum 4", "data-parallel 2"), log[-3000:]
    assert summary(tmp_path / "batch_resumed")["ds_config"]["gradient_accumulation_steps"] == 4


# --- a stop request reaches a rank that waits inside a collective ---------------------------------

def _wait_in_a_collective(rank: int, port: int, result: "mp.Queue") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), BIGTRAIN_STOP_GRACE_S="2")
    import torch
    from bigtrain.distributed.lifeline import Lifeline
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=300))
    line = Lifeline.start(rank)
    result.put(("ready", rank, os.getpid()))
    if rank == 0:
        time.sleep(120)  # never joins: rank 1 waits in its all-reduce (the hung sample, a stuck peer)
    line.set_phase("the loss all-reduce of step 7")
    torch.distributed.all_reduce(torch.ones(1))
    result.put(("returned", rank, 0))


def test_sigterm_reaches_a_rank_inside_a_collective(tmp_path):
    import torch  # noqa: F401 -- imported once here; the forked ranks share it
    ctx = mp.get_context("fork")
    result = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_wait_in_a_collective, args=(rank, port, result)) for rank in (0, 1)]
    for p in procs:
        p.start()
    try:
        pids = {}
        while len(pids) < 2:
            _, rank, pid = result.get(timeout=120)
            pids[rank] = pid
        time.sleep(0.5)  # rank 1 is inside the all-reduce now
        os.kill(pids[1], signal.SIGTERM)
        sent = time.monotonic()
        procs[1].join(timeout=60)
        seconds = time.monotonic() - sent
        assert procs[1].exitcode == 128 + signal.SIGTERM, procs[1].exitcode
        # grace 2 s here (50 s by default: within a minute of the signal); the bound is the collective's 300 s
        # timeout, which it must not wait for, with room for a machine busy enough to delay a 0.5 s poll
        assert seconds < 30, seconds
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)


RANK = """
import sys, time
sys.path.insert(0, {repo!r})
from bigtrain.distributed.lifeline import Lifeline
line = Lifeline.start(0)
print("watching", [a.pid for a in line.ancestors], flush=True)
deadline = time.monotonic() + 30
while not line.requested and time.monotonic() < deadline:
    time.sleep(0.05)
print("stop:", line.reason, flush=True)
"""
STAND_IN = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', sys.argv[1]]); time.sleep(60)"


def test_a_rank_stops_when_its_launcher_is_gone():
    """Killing the launcher (here a stand-in named like DeepSpeed's per-node launch) makes its rank stop."""
    launcher = subprocess.Popen([sys.executable, "-c", STAND_IN, RANK.format(repo=str(REPO)),
                                 "deepspeed.launcher.launch"],
                                env={**os.environ, "LOCAL_RANK": "0"}, stdout=subprocess.PIPE, text=True)
    try:
        watching = launcher.stdout.readline()
        assert watching == f"watching [{launcher.pid}]\n", watching
        launcher.kill()
        killed = time.monotonic()
        stop = launcher.stdout.readline()
        assert stop.startswith("stop: ") and naming(stop, "launcher", "deepspeed", f"pid {launcher.pid}", "gone"), stop
        assert time.monotonic() - killed < 15  # polled every 0.5 s; the rank itself gives up after 30 s
    finally:
        launcher.kill()
        launcher.wait()
