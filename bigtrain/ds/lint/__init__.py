"""Lint a DeepSpeed config the way DeepSpeed itself would judge it, before any rank trains.

Beside `generate -> batch -> resolve`: `resolve` runs the lint on the dict the engine will get, and
callers catch `LintError` and describe the device with `DeviceCaps` from here. Nothing here imports
the rest of `ds/`, so the lint cannot come to depend on what it judges.

`judge`    the one pass (`lint_problems`): keys, values and types against what DeepSpeed reads,
           a user's JSON read with every duplicate key named (`read_ds_json`)
`checks`   what `deepspeed.initialize` checks beyond the keys: batch triple, layout, device, parallelism
`levers`   ZeRO++, Muon against ZeRO, expert parallelism (DeepSpeed 0.17-0.19)
`optim`    the optimizer and scheduler DeepSpeed would build, checked without training
`schema`   what DeepSpeed reads, asked of the installed DeepSpeed at run time
"""
from bigtrain.ds.lint import schema
from bigtrain.ds.lint.checks import BATCH_KEYS, DeviceCaps, Problem, holds_nowhere
from bigtrain.ds.lint.judge import (LintError, errors, key_warnings, lint_problems, read_ds_json, semantic_problems,
                                    unknown_keys, validate_with_deepspeed, warnings)

__all__ = ["BATCH_KEYS", "DeviceCaps", "LintError", "Problem", "errors", "holds_nowhere", "key_warnings",
           "lint_problems", "read_ds_json", "schema", "semantic_problems", "unknown_keys", "validate_with_deepspeed",
           "warnings"]
