"""Checkpoints: save and resume through DeepSpeed (`store`), the typed and versioned state beside
DeepSpeed's files (`state`), loading that never runs code from a file (`safe_load`), and reshaping
through universal checkpoints (`universal`)."""
