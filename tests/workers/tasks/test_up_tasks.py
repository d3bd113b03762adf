"""`specfleet up` runs the Celery worker too: a batch submitted to it completes; Ctrl-C stops everything."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

from tests.conftest import FAST_TIMINGS
from tests.gateway.test_launcher import _alive, _children
from tests.tasks_fixtures import REPO_ROOT


def test_up_starts_celery_and_a_batch_completes(tiny_target: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECFLEET_") and k != "REDIS_URL"}
    env.update({f"SPECFLEET_{k.upper()}": str(v) for k, v in FAST_TIMINGS.items()})
    env["SPECFLEET_REDIS_DIR"] = str(tmp_path / "redis")
    up = subprocess.Popen(
        [sys.executable, "-m", "shared.cli", "up", "--port", "0", "--target", str(tiny_target)],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in up.stdout or []], daemon=True)
    reader.start()
    try:
        line = ""
        while not line.startswith("specfleet: gateway at "):
            line = lines.get(timeout=180)
            if line.startswith("specfleet: api key "):  # dev mode prints a key before the URL
                env["SPECFLEET_API_KEY"] = line.removeprefix("specfleet: api key ").strip()
        url = line.removeprefix("specfleet: gateway at ").strip()
        children = _children(up.pid)
        source = tmp_path / "in.jsonl"
        source.write_text(
            "".join(
                json.dumps(
                    {
                        "custom_id": f"c{i}",
                        "method": "POST",
                        "url": "/v1/jobs",
                        "body": {"prompt": "def f(", "max_tokens": 2},
                    }
                )
                + "\n"
                for i in range(3)
            )
        )
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "shared.cli",
                "batch",
                "submit",
                str(source),
                "--wait",
                "-o",
                str(tmp_path / "out.jsonl"),
                "--url",
                url,
            ],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 3
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
        assert [pid for pid in children if _alive(pid)] == []
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        reader.join(timeout=5)
        if up.stdout:
            up.stdout.close()
