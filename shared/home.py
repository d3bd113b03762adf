"""$SPECFLEET_HOME: the cache root of every machine-local artifact (demo models, compiled kernels)."""

import os
from pathlib import Path

SPECFLEET_HOME_ENV = "SPECFLEET_HOME"
DEFAULT_SPECFLEET_HOME = Path("~/.cache/specfleet")


def specfleet_home(home: Path | None = None) -> Path:
    """The cache root: `home`, else $SPECFLEET_HOME, else ~/.cache/specfleet."""
    return (home or Path(os.environ.get(SPECFLEET_HOME_ENV) or DEFAULT_SPECFLEET_HOME)).expanduser()
