"""One node through `bigtrain train` (the README's first command), then a real two-node job on one
machine: two DeepSpeed launchers (`--no_ssh --node_rank R`) over loopback, through
scripts/local_two_node.sh and through scripts/slurm_train.sbatch (with srun and scontrol played by
small shell scripts, since there is no slurm here). The two-node losses must equal those of the
single-node 2-rank run: the same math on the same data. The single-node run is the wrapper's, so one
launch checks both."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from launch import BIN, REPO, TINY, free_port, rank_env, summary
from messages import naming

ARGS = [*TINY, "--steps", "4", "--set", "train.eval_interval=0"]

FAKE_SRUN = """#!/usr/bin/env bash
# srun on one machine: the command once per node, with that node's SLURM_NODEID
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((n = 0; n < SLURM_NNODES; n++)); do SLURM_NODEID=$n "$@" & pids+=($!); done
status=0
for p in "${pids[@]}"; do wait "$p" || status=$?; done
exit $status
"""
FAKE_SCONTROL = "#!/usr/bin/env bash\nprintf 'localhost\\n127.0.0.1\\n'\n"


def assert_same_losses(reference: list[float], other: list[float]) -> None:
    assert len(other) == len(reference) == 4
    assert max(abs(a - b) for a, b in zip(reference, other)) <= 1e-6, (reference, other)


def fake_slurm(tmp_path: Path) -> dict:
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    return rank_env(PATH=f"{fake}:{rank_env()['PATH']}", SLURM_JOB_NODELIST="node[1-2]", SLURM_NNODES="2",
                    SLURM_JOB_ID="7", SLURM_GPUS_ON_NODE="1", SLURM_CPUS_PER_TASK="1", REPO=str(REPO),
                    VENV=str(BIN.parent), MASTER_PORT=str(free_port()))


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`bigtrain train` on this machine: 2 ranks through DeepSpeed's per-node launcher (no runner: one machine)."""
    out = tmp_path_factory.mktemp("one_node") / "run"
    proc = subprocess.run([str(Path(sys.executable).parent / "bigtrain"), "train", "--master-port", str(free_port()),
                           "--out", str(out), *ARGS], cwd=REPO, env=rank_env(), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


def test_bigtrain_train_wrapper_launches_two_ranks_with_a_quiet_console(one_node):
    out, proc = one_node
    assert "-m deepspeed.launcher.launch --world_info=" in proc.stderr and summary(out)["world_size"] == 2
    # The console is bigtrain's: DeepSpeed's log, its op-build prints and torch's warnings are in the rank logs.
    console = proc.stdout + proc.stderr
    for noise in ("Setting accelerator", "[INFO] [launch.py", "built successfully", "FutureWarning",
                  "Attempting to get learning rate"):
        assert noise not in console, noise
    assert "step 4/4 | loss " in proc.stdout and (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    logs = (out / "logs" / "rank0.log").read_text() + (out / "logs" / "rank1.log").read_text()
    assert naming(logs, "deepspeed_shm_comm_op", "built successfully"), logs[-3000:]  # DeepSpeed's own log line


def test_two_nodes_on_loopback_train_and_resume_like_one_node(one_node, tmp_path):
    single_node = summary(one_node[0])["losses"]

    # Two launchers, stopped after step 2 (a job out of time) ...
    out = tmp_path / "two_nodes"
    proc = subprocess.run(["bash", str(REPO / "scripts" / "local_two_node.sh"), "--", "--out", str(out), *ARGS,
                           "--stop-after", "2"], cwd=REPO, env=rank_env(DEEPSPEED=str(BIN / "deepspeed")),
                          capture_output=True, text=True, timeout=240)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    for rank in (0, 1):
        assert f"[node {rank}] " in log and naming(log, "nnodes=2", "num_local_procs=1", f"node_rank={rank}"), log
    stopped = summary(out)
    assert stopped["world_size"] == 2 and stopped["steps"] == 2 and stopped["stopped_by"] == "stop_after"
    assert max(abs(a - b) for a, b in zip(single_node[:2], stopped["losses"])) <= 1e-6

    # ... then the slurm script on the same output directory: it finds the checkpoint and resumes.
    proc = subprocess.run(["bash", str(REPO / "scripts" / "slurm_train.sbatch"), "--out", str(out), *ARGS],
                          cwd=tmp_path, env=fake_slurm(tmp_path), capture_output=True, text=True, timeout=240)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert (out / "hostfile").read_text() == "localhost slots=1\n127.0.0.1 slots=1\n"
    assert naming(log, "slurm job 7", "2 nodes", "1 ranks", "localhost:"), log[-5000:]
    assert naming(log, "batch: ", "train_batch_size 8", "micro 4", "accum 1", "data-parallel 2"), log  # its preflight
    assert naming(log, "resuming", "newest complete checkpoint") and "resumed from" in log, log[-5000:]
    resumed = summary(out)
    assert resumed["steps"] == 4 and resumed["world_size"] == 2 and resumed["stopped_by"] == ""
    assert_same_losses(single_node, resumed["losses"])
