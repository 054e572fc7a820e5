"""Run config + optional user JSON + world + device -> the DeepSpeed dict: generation (`generate`), the batch
triple (`batch`), a user's JSON resolved and filled (`resolve`), lint (`lint`) against a schema read from the
installed DeepSpeed (`schema`), per-job adjustments (`runtime`) and the checked-in `ds_configs/` (`files`)."""
