"""`python -m bigtrain.generate --mode generate|chat ...`: what each rank of `bigtrain generate --zero3` runs."""
import sys

from bigtrain.generate.command import rank_main

if __name__ == "__main__":
    sys.exit(rank_main())
