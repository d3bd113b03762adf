"""The benchmarks behind `specfleet bench NAME`.

May import: shared/ (the fleet launcher shared/fleet.py among it) and the rest of workers/; never gateway/.
"""
