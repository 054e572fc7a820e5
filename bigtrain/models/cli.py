"""`bigtrain models [FAMILY] [--set model.overrides.KEY=VALUE]`: the zoo's families and named sizes, with
parameters, training FLOPs per sample and pipeline layers. Builds no weights."""
from __future__ import annotations

import argparse
from typing import Any


def model_override_sets(items: list[str]) -> dict[str, Any]:
    """`--set model.overrides.KEY=VALUE` items -> {KEY: VALUE}: the run config's key, as every verb takes it.

    A bare `KEY=VALUE`, the old spelling here, is refused with the new one."""
    import yaml
    overrides = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. --set model.overrides.n_layer=24")
        if not key.startswith("model.overrides.") or key == "model.overrides.":
            raise ValueError(f"--set {item!r}: a model's shape is set as --set model.overrides.{key.split('.')[-1]}"
                             f"={raw} (the run config's key, as every verb takes it)")
        overrides[key.removeprefix("model.overrides.")] = yaml.safe_load(raw)
    return overrides


def table(family: str | None, overrides: dict[str, Any]) -> str:
    """One line per (family, named size); ValueError for an unknown family or override."""
    from bigtrain.models.registry import build, canonical, families  # torch: not for `bigtrain --help`
    from bigtrain.models.registry import family as family_of
    fams = families()
    family = canonical(family) if family is not None else None
    if family is not None and family not in fams:
        raise ValueError(f"unknown model family {family!r}; choose one of: {', '.join(fams)}")
    lines = [f"{'family':<8} {'size':<7} {'params':>10} {'train GFLOP/sample':>19} {'tokens':>7} {'layers':>7}  "
             "splits"]
    for fam in [family] if family else list(fams):
        keys = family_of(fam).override_keys()
        unknown = sorted(set(overrides) - set(keys))
        if unknown:
            raise ValueError(f"unknown override(s) {', '.join(unknown)} for {fam}; allowed: {', '.join(keys)}")
        for size in fams[fam]:
            if size == "custom":
                continue
            try:
                spec = build(fam, size, **overrides)
            except ValueError as err:  # e.g. seq_len beyond this size's n_positions
                lines.append(f"{fam:<8} {size:<7} skipped: {err}")
                continue
            tokens = str(spec.tokens_per_sample) if spec.tokens_per_sample else "-"
            lines.append(f"{fam:<8} {size:<7} {spec.num_params / 1e6:>9.2f}M {spec.flops_per_sample / 1e9:>19.2f} "
                         f"{tokens:>7} {len(spec.layers()):>7}  {splits(family_of(fam))}")
    lines.append("hf       (a directory's shape)  " + splits(family_of("hf")) + " (sequence: decoders with sdpa; "
                 "mixture-of-experts directories train under ZeRO, their router loss included)")
    lines.append("vlm      (a directory's shape)  " + splits(family_of("vlm")) + " (vision-language models: "
                 "AutoModelForImageTextToText with the processor saved beside it)")
    return "\n".join(lines)


def splits(family: Any) -> str:
    """The ways a family's model can be split, in the order of `bigtrain.models.family.PARALLEL_MODES`."""
    from bigtrain.models.family import PARALLEL_MODES
    return ",".join(mode for mode in PARALLEL_MODES if mode in family.parallel)


def cmd_models(args: argparse.Namespace) -> int:
    print(table(args.family, model_override_sets(args.set)))
    return 0


def add_models_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `bigtrain models` on the CLI's subparsers."""
    p = subparsers.add_parser("models", help="list model families and sizes: parameters, FLOPs, pipeline layers")
    p.add_argument("family", nargs="?", help="only this family (gpt2, llama, encoder = transformer, resnet; hf models "
                                             "take their shape from a directory)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override applied to every size, e.g. --set model.overrides.seq_len=256 (repeatable)")
    p.set_defaults(func=cmd_models)
