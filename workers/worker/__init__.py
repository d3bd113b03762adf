"""The fleet worker: pulls jobs from Redis, drives the engine, streams tokens back (see main.Worker.step)."""
