"""`python -m bigtrain.eval TARGET --tasks ...`: one rank of `bigtrain eval` (the launcher starts one per device)."""
import os

if os.environ.get("RANK", "0") != "0":
    os.environ.setdefault("TQDM_DISABLE", "1")  # before anything imports tqdm: rank 0's progress bars only

from bigtrain.eval.command import rank_main  # noqa: E402

if __name__ == "__main__":
    from bigtrain.distributed.world import exit_now
    exit_now(rank_main())
