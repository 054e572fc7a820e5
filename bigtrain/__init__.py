"""bigtrain: train large models with DeepSpeed."""
__version__ = "0.1.0"
