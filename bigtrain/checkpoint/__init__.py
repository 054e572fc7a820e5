"""Save and resume through DeepSpeed's checkpoints (`store`), and reshape through universal checkpoints
(`universal`)."""
