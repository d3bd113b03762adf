"""The offline demo pair (build, train, tokenizer, measure) and tiny random models for tests.

May import: shared/, workers/engine, workers/models (resolve.py fills an EngineConfig with the pair's dirs).
"""
