"""Speculative decoding, engine-independent: verification, token trees, n-gram proposals, adaptive k."""
