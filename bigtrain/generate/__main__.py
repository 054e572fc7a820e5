"""`python -m bigtrain.generate --mode generate|chat ...`: what each rank of `bigtrain generate --zero3` runs."""

from bigtrain.generate.command import rank_main

if __name__ == "__main__":
    from bigtrain.distributed.world import exit_now
    exit_now(rank_main())
