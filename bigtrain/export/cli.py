"""`bigtrain export CKPT_DIR --out DIR [--tag TAG] [--force] [--tokenizer DIR] [--adapter]`."""
from __future__ import annotations

import argparse

EPILOG = """CKPT_DIR may be a run's --out directory, its checkpoints/ directory, or one step_NNNNNN
directory. ZeRO-0/1/2/3 and pipeline checkpoints are consolidated on CPU in one process.
GPT-2, Llama and --model hf runs are written as Hugging Face directories (AutoModelForCausalLM or
AutoModelForSequenceClassification / AutoTokenizer load them), and the export reloads itself to check;
other models as model.safetensors + bigtrain_model.json (bigtrain.export.load_exported).
A LoRA run (lora.r > 0) is written with its adapters merged into the base weights, or with --adapter
as the peft adapter directory alone (PeftModel.from_pretrained(base, DIR) loads it)."""


def add_export_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `export` verb; its handler returns the exit code."""
    p = subparsers.add_parser("export", help="consolidate a checkpoint into safetensors (a Hugging Face directory for gpt2, llama, hf)",
                              description=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt_dir", help="run out dir, checkpoint dir, or one step_NNNNNN dir")
    p.add_argument("--out", required=True, help="directory to write (must be new or empty, see --force)")
    p.add_argument("--tag", help="checkpoint to export, e.g. step_000120 or 120 (default: newest complete)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("--tokenizer", help="tokenizer dir or name to save beside the model (default: the run's)")
    p.add_argument("--max-shard-size", "--max_shard_size", dest="max_shard_size", default="5GB",
                   help="Hugging Face exports: weights above this size are split into several safetensors files "
                        "(default 5GB)")
    p.add_argument("--adapter", action="store_true",
                   help="a LoRA run (lora.r > 0): write only the peft adapter directory (adapter_config.json, "
                        "adapter_model.safetensors) for peft.PeftModel.from_pretrained(base, DIR); without it the "
                        "adapters are merged into the base weights")
    p.add_argument("--trust-checkpoint", "--trust_checkpoint", dest="trust_checkpoint", action="store_true",
                   help="unpickle any type in the checkpoint's files (runs code from them); only for checkpoints "
                        "you trust. Without it a file needing more than DeepSpeed's types is refused")
    p.set_defaults(func=cmd_export)
    return p


def cmd_export(args: argparse.Namespace) -> int:
    from bigtrain.metrics.logs import quiet_hf_progress_bars
    quiet_hf_progress_bars()
    from bigtrain.export.exporter import export_checkpoint

    result = export_checkpoint(args.ckpt_dir, args.out, tag=args.tag, force=args.force, tokenizer=args.tokenizer,
                               trust_checkpoint=args.trust_checkpoint, max_shard_size=args.max_shard_size,
                               adapter=args.adapter)
    print(f"exported {result.checkpoint} ({result.layout}, {result.num_params / 1e6:.2f}M parameters) "
          f"to {result.out} ({result.format}{', with tokenizer' if result.tokenizer else ''})")
    print(f"  verified: reloaded with {result.verified_by}, largest logit difference on a fixed batch "
          f"{result.max_logit_diff:.3g}")
    for note in result.notes:
        print(f"  {note}")
    return 0
