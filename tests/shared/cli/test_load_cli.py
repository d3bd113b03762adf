"""`specfleet load --prompts FILE`: a file it cannot read, or a JSON line without a prompt, is refused naming it
before any request (real subprocess; nothing listens at the URL)."""

import os
import subprocess
import sys
from pathlib import Path

from shared.redis_server import free_port
from tests.helpers import REPO_ROOT


def _load(prompts: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "400"}  # typer's error box, one line wide enough for the message
    return subprocess.run(
        [sys.executable, "-m", "shared.cli", "load", "--url", f"http://127.0.0.1:{free_port()}", "--duration", "0.1",
         "--prompts", str(prompts)],  # fmt: skip
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_a_prompts_file_it_cannot_use_is_refused_naming_it(tmp_path: Path) -> None:
    """Both were Python tracebacks (FileNotFoundError; KeyError 'prompt')."""
    missing = _load(tmp_path / "nowhere.txt")
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('def f(x):\n{"text": "no prompt here"}\n')
    refused = _load(bad)
    assert refused.returncode == 2 and f'{bad} line 2: a JSON line needs a "prompt"' in refused.stderr
    assert "Traceback" not in missing.stderr + refused.stderr
