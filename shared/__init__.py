"""What both sides use: Redis keys and Lua, schemas, settings, job and batch state, the submit call
(submit.py), the HTTP client (client.py), the fleet launcher (fleet.py).

May import: nothing of gateway/ or workers/, except the CLI package shared/cli/, the one place that wires
both sides. tests/test_boundaries.py keeps this.
"""
