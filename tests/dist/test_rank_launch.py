"""The suite's own start of ranks for tests of the math (tests/launch.py: launch_ranks): the ranks meet at the store
it hosts, as torchrun's meet at its agent's, and the first rank to fail ends the launch at once, as torchrun ends it,
instead of leaving its peers waiting at the rendezvous."""
from __future__ import annotations

import re
import time

from launch import launch_ranks, rank_env

SCRIPT = '''import os, sys
from datetime import timedelta
import torch
import torch.distributed as dist
if sys.argv[1] == "fail" and os.environ["RANK"] == "1":
    sys.exit(3)
dist.init_process_group("gloo", timeout=timedelta(minutes=10))
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: {total.item()}", flush=True)
dist.destroy_process_group()
'''


def test_ranks_meet_at_the_store_and_a_failed_rank_ends_the_launch(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    done = launch_ranks(script, ["meet"], 2, env=rank_env(), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    # one output for both ranks, as torchrun's: their lines may interleave
    assert sorted(re.findall(r"rank \d of \d: [\d.]+", done.stdout)) == ["rank 0 of 2: 3.0", "rank 1 of 2: 3.0"]
    started = time.monotonic()
    failed = launch_ranks(script, ["fail"], 2, env=rank_env(), timeout=120)
    assert failed.returncode == 3 and time.monotonic() - started < 60  # rank 0 alone would wait 10 minutes
