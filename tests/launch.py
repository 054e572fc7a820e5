"""Start real ranks through the deepspeed launcher (or plain python) and read back what they wrote."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bigtrain.distributed.rendezvous import free_port  # noqa: F401 -- the tests take it from here

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TINY = ["--size", "tiny", "--set", "data.vocab_size=512", "--set", "data.seq_len=64", "--set", "precision=fp32",
        "--set", "logging.progress_bar=false", "--set", "train.sample_tokens=0", "--peak-tflops", "1"]
# A run from random weights gets these by default; a run from a pretrained directory gets its objective's
# fine-tuning defaults (2e-5 for lm), at which a few steps hardly move a tiny model: comparisons of curves from a
# directory that were tuned at pretraining's rate keep it with this.
PRETRAINING_RATE = ["--set", "optimizer.lr=6e-4", "--set", "optimizer.weight_decay=0.1",
                    "--set", "schedule.warmup_steps=20"]


# What a launcher sets for its ranks: never inherited from a test process that made a process group of its own.
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


def rank_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(OMP_NUM_THREADS="1", DEEPSPEED_TIMEOUT="2", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.update(extra)
    from bigtrain.distributed.op_builds import use_environment_ops_dir
    use_environment_ops_dir(env)  # where bigtrain's own launches build DeepSpeed's ops (a test's value kept)
    return env


def deepspeed_cmd(script: str | Path, args: list[str], num_ranks: int = 2) -> list[str]:
    """DeepSpeed's launcher, as the README launches bigtrain: for tests of launching, runs and their exits."""
    return [str(BIN / "deepspeed"), "--num_gpus", str(num_ranks), "--master_port", str(free_port()), str(script),
            *args]


def torchrun_cmd(script: str | Path, args: list[str], num_ranks: int = 2) -> list[str]:
    """torchrun (a launcher bigtrain supports as well: test_runner), for tests of a launch through it: the same
    ranks, process group and DeepSpeed engine as DeepSpeed's launcher, which costs ~5 s more per launch here (its
    runner and launch.py each import DeepSpeed, and launch.py polls its ranks once a second).
    --standalone: the launcher's own store binds a port the kernel picks and the ranks meet there, so no port is
    picked here and bound seconds later (when another launch on the machine may have taken it)."""
    return [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(num_ranks), str(script), *args]


def launch_ranks(script: str | Path, args: list[str], num_ranks: int = 2, *, env: dict,
                 timeout: float) -> subprocess.CompletedProcess:
    """`num_ranks` ranks of `script` started here as torchrun's agent starts them, for tests of the math: its
    variables, and the store its agent hosts (here, in the test's process, on a port the kernel picks; the ranks
    meet there as torchrun's do, TORCHELASTIC_USE_AGENT_STORE), without the agent's process and its torch import
    (~1.1 CPU s a launch). As torchrun does, the first rank to fail ends the others; past `timeout`, all end and
    subprocess.TimeoutExpired is raised. The ranks' stdout and stderr, each shared by all ranks as torchrun's are,
    come back in a CompletedProcess. Tests of launching (signals, exits, the lifeline a rank keeps to its launcher)
    use the launchers themselves: torchrun_cmd, deepspeed_cmd."""
    from torch.distributed import TCPStore
    store = TCPStore("127.0.0.1", 0, num_ranks, is_master=True, wait_for_workers=False)
    world = {"WORLD_SIZE": str(num_ranks), "LOCAL_WORLD_SIZE": str(num_ranks), "GROUP_RANK": "0",
             "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(num_ranks),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
             "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "tests"}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        ranks = [subprocess.Popen([sys.executable, "-u", str(script), *args], cwd=REPO, stdout=out, stderr=err,
                                  env={**env, **world, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)})
                 for r in range(num_ranks)]
        deadline = time.monotonic() + timeout
        try:
            while None in (codes := [rank.poll() for rank in ranks]):
                if any(codes):  # a rank failed: its peers would wait for it at the next collective
                    break
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired([str(script), *args], timeout)
                time.sleep(0.05)
        finally:
            for rank in ranks:
                if rank.poll() is None:
                    rank.kill()
                rank.wait()
            del store
        code = next((code for code in codes if code), 0)  # the first rank's to fail, not its killed peers'
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess([str(script), *args], code, out.read(), err.read())


def run_train(out: Path, args: list[str], num_ranks: int = 2, timeout: int = 300, check: bool = True,
              tiny: bool = True) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus N bigtrain/run.py --out OUT ARGS` (tiny GPT-2, fp32 by default)."""
    cmd = deepspeed_cmd(REPO / "bigtrain" / "run.py", ["--out", str(out), *(TINY if tiny else []), *args], num_ranks)
    proc = subprocess.run(cmd, cwd=REPO, env=rank_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}")
    return proc


def summary(out: Path) -> dict:
    return json.loads((Path(out) / "summary.json").read_text())


JOBS_SCRIPT = REPO / "tests" / "dist_scripts" / "equiv_runs.py"


def launch_jobs(root: Path, jobs: list[dict], num_ranks: int = 2, *, name: str = "plan", timeout: int = 600,
                script: Path = JOBS_SCRIPT, **env: str) -> str:
    """Several runner jobs one after another in one launch of `script` (equiv_runs.py: each job
    {"name", "args", "copy_from"?, "expect_error"?}; see its docstring), because on 2 cores a launch's
    start-up costs far more than a tiny job. One rank is a plain `python` process (a world of one, as bigtrain runs
    one: `bigtrain.distributed.rendezvous.single_process_env`); several are started as torchrun starts them
    (`launch_ranks`). Returns the launch's stdout (rank 0's log)."""
    root.mkdir(parents=True, exist_ok=True)
    plan = root / f"{name}.json"
    plan.write_text(json.dumps(jobs))
    args = [str(root), str(plan)]
    if num_ranks == 1:
        proc = subprocess.run([sys.executable, str(script), *args], cwd=REPO, env=rank_env(**env),
                              capture_output=True, text=True, timeout=timeout)
    else:
        proc = launch_ranks(script, args, num_ranks, env=rank_env(**env), timeout=timeout)
    assert proc.returncode == 0, f"launch failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout
