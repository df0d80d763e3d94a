"""Trainer adapters: one module per framework, each mapping tokenkeep's `Batch`/trajectory
rows onto that framework's types, nothing else."""
