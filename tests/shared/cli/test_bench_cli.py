"""`specfleet bench`: a --json path it cannot write is refused before the benchmark runs (real subprocess)."""

import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO_ROOT


def test_a_json_path_it_cannot_write_is_refused_before_measuring(tmp_path: Path) -> None:
    """It was found only when the results were written, minutes of measuring later (here a file stands where the
    JSON's folder would be)."""
    (tmp_path / "a_file").write_text("")
    refused = subprocess.run(
        [sys.executable, "-m", "shared.cli", "bench", "e2e", "--json", str(tmp_path / "a_file" / "x.json")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2
    assert refused.stderr.startswith(f"error: --json {tmp_path / 'a_file' / 'x.json'}: cannot make its folder")
    is_dir = subprocess.run(
        [sys.executable, "-m", "shared.cli", "bench", "e2e", "--json", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert is_dir.returncode == 2 and "not a file this process may write" in is_dir.stderr
