"""The `specfleet` command line: one module per command group, registered on the root app in main.py.

    fleet.py     up, gateway, worker, tasks  (up's run: up.py, over the launcher shared/fleet.py)
    jobs.py      submit, status, stream, cancel  (HTTP helpers: common.py)
    batch.py     batch submit|status|results|cancel|list
    keys.py      keys create|list|revoke
    models.py    models build-demo|path|measure-demo
    generate.py  generate  (the engine in-process)
    bench.py     bench NAME

This package is the one place that imports both gateway/ and workers/ (nothing imports it). Heavy imports
(torch, uvicorn, redis, the two sides) stay inside the command functions, so `specfleet --help` is fast.
"""
