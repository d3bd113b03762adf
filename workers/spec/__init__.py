"""Speculative decoding's algorithms, as pure functions and small value types: verification (chains, trees,
a step's batch), token trees, n-gram lookup, the adaptive speculation length, the (temperature, top-k,
top-p) distributions, per-sequence speculation state and the Proposal / Verdict hand-offs.

May import: torch, the standard library, `shared`, and `workers.spec` itself. Never `workers.engine` (nor the
worker, tasks, demo or bench code): the engine imports spec, drives the proposers and applies what spec returns.
"""
