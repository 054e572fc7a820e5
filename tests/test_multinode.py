"""A real two-node job on one machine: two DeepSpeed launchers (`--no_ssh --node_rank R`) over
loopback, through scripts/local_two_node.sh and through scripts/slurm_train.sbatch (with srun and
scontrol played by small shell scripts, since there is no slurm here). The losses must equal those
of the single-node 2-rank run: the same math on the same data."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from launch import BIN, REPO, TINY, free_port, rank_env, run_train, summary

pytestmark = pytest.mark.dist
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


def test_two_nodes_on_loopback_train_and_resume_like_one_node(tmp_path):
    run_train(tmp_path / "one_node", ARGS, tiny=False)
    single_node = summary(tmp_path / "one_node")["losses"]

    # Two launchers, stopped after step 2 (a job out of time) ...
    out = tmp_path / "two_nodes"
    proc = subprocess.run(["bash", str(REPO / "scripts" / "local_two_node.sh"), "--", "--out", str(out), *ARGS,
                           "--stop-after", "2"], cwd=REPO, env=rank_env(DEEPSPEED=str(BIN / "deepspeed")),
                          capture_output=True, text=True, timeout=240)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    for rank in (0, 1):
        assert f"[node {rank}] " in log and f"nnodes=2, num_local_procs=1, node_rank={rank}" in log
    stopped = summary(out)
    assert stopped["world_size"] == 2 and stopped["steps"] == 2 and stopped["stopped_by"] == "stop_after"
    assert max(abs(a - b) for a, b in zip(single_node[:2], stopped["losses"])) <= 1e-6

    # ... then the slurm script on the same output directory: it finds the checkpoint and resumes.
    proc = subprocess.run(["bash", str(REPO / "scripts" / "slurm_train.sbatch"), "--out", str(out), *ARGS],
                          cwd=tmp_path, env=fake_slurm(tmp_path), capture_output=True, text=True, timeout=240)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert (out / "hostfile").read_text() == "localhost slots=1\n127.0.0.1 slots=1\n"
    assert "slurm job 7: 2 nodes x 1 ranks, master localhost:" in log
    assert "batch: train_batch_size 8 = micro 4 x accum 1 x data-parallel 2" in log  # its preflight
    assert "resuming from the newest complete checkpoint" in log and "resumed from" in log
    resumed = summary(out)
    assert resumed["steps"] == 4 and resumed["world_size"] == 2 and resumed["stopped_by"] == ""
    assert_same_losses(single_node, resumed["losses"])
