"""`bigtrain recipes`: the run configs bigtrain ships for the jobs people run, as torchtune's `tune ls` / `tune cp`.

    bigtrain recipes                                  # one line each: job, model, GPUs, estimated memory per GPU
    bigtrain recipes show llama3.1-8b-sft-lora        # the file
    bigtrain recipes cp llama3.1-8b-sft-lora my.yaml  # a copy to edit
    bigtrain train --num-gpus 1 --config my.yaml      # and train it
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ACTIONS = ("ls", "show", "cp")


def add_recipes_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("recipes", help="list, show or copy the run configs shipped for common jobs",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", nargs="?", default="ls", choices=ACTIONS,
                   help="ls (default): one line per recipe; show NAME: print it; cp NAME DEST: copy it to DEST")
    p.add_argument("name", nargs="?", default=None, help="a recipe's name (from `bigtrain recipes`)")
    p.add_argument("dest", nargs="?", default=None, help="cp: the file (or folder) to write")
    p.add_argument("--force", action="store_true", help="cp: overwrite DEST if it exists")
    p.add_argument("--no-estimate", action="store_true",
                   help="ls: leave out the memory estimate (it builds each model's shape: a few seconds each)")
    p.set_defaults(func=cmd_recipes)


def cmd_recipes(args: argparse.Namespace) -> int:
    from bigtrain.recipes.catalog import recipe
    if args.action == "ls":
        if args.name or args.dest:
            raise ValueError("`bigtrain recipes` lists them all; `bigtrain recipes show NAME` prints one")
        return list_recipes(estimated=not args.no_estimate)
    if not args.name:
        raise ValueError(f"`bigtrain recipes {args.action}` needs a recipe's name; `bigtrain recipes` lists them")
    found = recipe(args.name)
    if args.action == "show":
        print(found.path.read_text(), end="")
        return 0
    if not args.dest:
        raise ValueError(f"`bigtrain recipes cp {found.name}` needs where to write it, e.g. "
                         f"`bigtrain recipes cp {found.name} {found.name}.yaml`")
    dest = Path(args.dest).expanduser()
    if dest.is_dir():
        dest = dest / found.path.name
    if dest.exists() and not args.force:
        raise ValueError(f"{dest} exists; pass --force to overwrite it, or give another DEST")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(found.path, dest)
    print(f"wrote {dest}: train it with `bigtrain train --num-gpus {found.hardware.gpus_per_node} --config {dest}` "
          f"(sized for {found.header['hardware']})")
    return 0


def list_recipes(estimated: bool = True) -> int:
    from bigtrain.metrics.logs import route_library_logs
    from bigtrain.recipes.catalog import recipes, summary_row
    route_library_logs()  # DeepSpeed's accelerator line stays off the table
    rows = []
    for item in recipes():
        if estimated:
            rows.append(summary_row(item))
        else:
            rows.append({"name": item.name, "job": item.header["job"], "model": item.header["model"],
                         "gpus": str(item.hardware)})
    print(f"{'recipe':<30}{'job':<46}{'model':<36}{'GPUs':<16}" + ("memory/GPU (estimate)" if estimated else ""))
    for row in rows:
        memory = f"{row['gib_per_gpu']:.1f} GiB, {row['setup']}" if estimated else ""
        print(f"{row['name']:<30}{_short(row['job'], 44):<46}{_short(row['model'], 34):<36}{row['gpus']:<16}{memory}")
    print("`bigtrain recipes show NAME` prints one (its header says the data and time it was sized for); "
          "`bigtrain recipes cp NAME my.yaml` copies it", file=sys.stderr)
    return 0


def _short(text: str, width: int) -> str:
    """The text before its first parenthesis or comma, cut to `width`."""
    head = text.split(" (")[0].split(", ")[0]
    return head if len(head) <= width else head[:width - 1] + "…"
