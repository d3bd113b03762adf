"""`python -m shared.cli ...` is `specfleet ...` (the launcher starts its children this way)."""

from shared.cli.main import main

if __name__ == "__main__":  # not when a spawned child (the worker's writer) imports it as __mp_main__
    main()
