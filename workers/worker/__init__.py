"""The fleet worker: pulls jobs from Redis, drives the engine, streams tokens back (see main.Worker.step).

May import: shared/ and the engine library (workers.engine, models, spec); never gateway/, tasks, demo or bench.
Redis I/O stays here: the engine never sees Redis.
"""
