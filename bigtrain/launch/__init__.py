"""Starting jobs: `bigtrain train` around the deepspeed launcher (`train`), `bigtrain preflight` (`preflight`)."""
