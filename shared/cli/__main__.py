"""`python -m shared.cli ...` is `specfleet ...` (the launcher starts its children this way)."""

from shared.cli.main import main

main()
