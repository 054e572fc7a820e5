"""The run configs bigtrain ships (*.yaml beside this file) and `bigtrain recipes` (catalog.py, cli.py)."""
