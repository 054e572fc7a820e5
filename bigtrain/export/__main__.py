"""`python -m bigtrain.export CKPT_DIR --out DIR`: the `bigtrain export` verb on its own."""
from __future__ import annotations

import argparse
import sys

from bigtrain.export.cli import add_export_parser


def main(argv: list[str] | None = None) -> int:
    """Exit code 0 on success; 2 with one line on stderr for a user's mistake, as `bigtrain` does."""
    parser = argparse.ArgumentParser(prog="python -m bigtrain")
    add_export_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["export", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except ValueError as err:
        print(f"bigtrain export: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
