"""Run config + optional user JSON + world + device -> the DeepSpeed dict, read in order: generation
(`generate`), the batch triple (`batch`), a user's JSON resolved and filled (`resolve`, with `auto` and
`mapping`), per-job adjustments (`runtime`) and the checked-in `ds_configs/` (`files`). Beside them the
lint (`lint/`), which judges the result by DeepSpeed's own rules against a schema read from the installed
DeepSpeed, and imports nothing else of `ds/`."""
