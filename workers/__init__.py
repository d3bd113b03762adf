"""The inference side: engine, models, spec (the engine library), worker, tasks (Celery), demo, bench.

May import: shared/ (never gateway/, never shared/cli/). The engine (engine/, models/, spec/) never imports
demo/, bench/, worker/ or tasks/. tests/test_boundaries.py keeps this.
"""
