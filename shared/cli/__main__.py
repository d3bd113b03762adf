"""`python -m shared.cli ...` is `specfleet ...` (the launcher starts its children this way)."""

from shared.cli.main import main

if __name__ == "__main__":  # importing it (a multiprocessing child's __mp_main__, a tool) runs nothing
    main()
