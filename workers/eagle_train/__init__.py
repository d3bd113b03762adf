"""Training EAGLE heads (`specfleet models train-eagle`) by self-distillation from their target.

Imports the engine's model code (workers.models) and nothing of the worker, tasks, demo or bench packages;
the engine never imports this package.
"""
