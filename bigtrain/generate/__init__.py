"""Talking to a model: `bigtrain generate TARGET --prompt ...` and `bigtrain chat TARGET` (command.py), with
transformers' sampling settings (sampling.py) and prompts from the command line or a file (prompts.py)."""
