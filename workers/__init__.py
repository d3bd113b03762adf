"""The inference side: engine, models, spec (the engine library), worker, tasks (Celery), demo, bench.

May import: shared/ (never gateway/, never shared/cli/). The engine (engine/, models/, spec/) never imports
demo/, bench/, worker/ or tasks/. tests/test_boundaries.py keeps this.
"""

import os

# oneDNN (torch's CPU matmuls) sets each matmul shape up once and keeps it in an LRU cache of 1,024 primitives
# by default: a target, a draft and an EAGLE head, each run at every token count of a step
# (Engine.warm_pass_shapes), need several thousand. Read at oneDNN's first matmul, so set before any model runs.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8192")
