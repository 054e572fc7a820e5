"""`bigtrain export CKPT_DIR --out DIR [--tag TAG] [--force] [--tokenizer DIR]`."""
from __future__ import annotations

import argparse

EPILOG = """CKPT_DIR may be a run's --out directory, its checkpoints/ directory, or one step_NNNNNN
directory. ZeRO-0/1/2/3 and pipeline checkpoints are consolidated on CPU in one process.
GPT-2 is written as a Hugging Face directory (AutoModelForCausalLM / AutoTokenizer load it);
other models as model.safetensors + bigtrain_model.json (bigtrain.export.load_exported)."""


def add_export_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `export` verb; its handler returns the exit code."""
    p = subparsers.add_parser("export", help="consolidate a checkpoint into safetensors (HF format for GPT-2)",
                              description=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt_dir", help="run out dir, checkpoint dir, or one step_NNNNNN dir")
    p.add_argument("--out", required=True, help="directory to write (must be new or empty, see --force)")
    p.add_argument("--tag", help="checkpoint to export, e.g. step_000120 or 120 (default: newest complete)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("--tokenizer", help="tokenizer dir or name to save beside the model (default: the run's)")
    p.add_argument("--trust-checkpoint", "--trust_checkpoint", dest="trust_checkpoint", action="store_true",
                   help="unpickle any type in the checkpoint's files (runs code from them); only for checkpoints "
                        "you trust. Without it a file needing more than DeepSpeed's types is refused")
    p.set_defaults(func=cmd_export)
    return p


def cmd_export(args: argparse.Namespace) -> int:
    from bigtrain.export.exporter import export_checkpoint

    result = export_checkpoint(args.ckpt_dir, args.out, tag=args.tag, force=args.force, tokenizer=args.tokenizer,
                               trust_checkpoint=args.trust_checkpoint)
    print(f"exported {result.checkpoint} ({result.layout}, {result.num_params / 1e6:.2f}M parameters) "
          f"to {result.out} ({result.format}{', with tokenizer' if result.tokenizer else ''})")
    for note in result.notes:
        print(f"  {note}")
    return 0
