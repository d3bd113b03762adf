"""The HTTP service (FastAPI): jobs, batches, OpenAI-compatible routes, SSE, auth and limits.

May import: shared/ (never workers/, never shared/cli/). tests/test_boundaries.py keeps this.
"""
