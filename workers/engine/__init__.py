"""The inference engine: requests in, tokens out, no Redis. Scheduler, block manager, model runner, the
speculator and draft proposer (orchestration over the runners), and the one place that applies a step's
results to its sequences (apply.py).

May import: torch, transformers (tokenizers), the standard library, `shared`, `workers.models` and
`workers.spec`. Never the worker, tasks, demo or bench code (the demo pair is resolved by the caller:
workers/demo/resolve.py), nor `gateway`. Nothing under `workers.spec` or `workers.models` imports the engine.
"""
