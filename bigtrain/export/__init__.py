"""`bigtrain export`: ZeRO-0/1/2/3 and pipeline checkpoints -> safetensors (a Hugging Face
directory for GPT-2), in one CPU process, never touching the checkpoint.

    locate.py    which checkpoint (run dir / checkpoint dir / tag dir, --tag)
    weights.py   one plain state dict from DeepSpeed's files (zero_to_fp32, pipeline layers)
    masters.py   fp32 master weights from ZeRO-1/2 optimizer files of any pipeline stage
    write.py     the output directory (atomic), strict loading
    read.py      an export loaded back as a user loads it: load_exported, load_adapter
    lora.py      a LoRA run merged, or its adapter alone
    exporter.py  export_checkpoint: the above in order
    cli.py       add_export_parser for bigtrain.cli
"""
from bigtrain.lazy import lazy_names

_WHERE = {"add_export_parser": "cli", "cmd_export": "cli", "ExportResult": "exporter", "export_checkpoint": "exporter",
          "Located": "locate", "locate_checkpoint": "locate", "load_exported": "read"}
__all__ = sorted(_WHERE)
__getattr__ = lazy_names(__name__, _WHERE)
