"""`bigtrain export`: ZeRO-0/1/2/3 and pipeline checkpoints -> safetensors (a Hugging Face
directory for GPT-2), in one CPU process, never touching the checkpoint.

    locate.py    which checkpoint (run dir / checkpoint dir / tag dir, --tag)
    weights.py   one plain state dict from DeepSpeed's files (zero_to_fp32, pipeline layers)
    masters.py   fp32 master weights from ZeRO-1/2 optimizer files of any pipeline stage
    write.py     the output directory (atomic), strict loading, load_exported
    exporter.py  export_checkpoint: the above in order
    cli.py       add_export_parser for bigtrain.cli
"""
from bigtrain.export.cli import add_export_parser, cmd_export
from bigtrain.export.exporter import ExportResult, export_checkpoint
from bigtrain.export.locate import Located, locate_checkpoint
from bigtrain.export.write import load_exported

__all__ = ["ExportResult", "Located", "add_export_parser", "cmd_export", "export_checkpoint", "load_exported",
           "locate_checkpoint"]
