"""`specfleet up`: one command brings up Redis + a worker + the gateway; Ctrl-C stops all, no orphans."""

import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from tests.conftest import FAST_TIMINGS

ROOT = Path(__file__).resolve().parents[2]


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_up_serves_jobs_and_ctrl_c_leaves_no_process(tiny_pair: tuple[Path, Path], tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "SPECFLEET_REDIS_URL")}
    env.update({f"SPECFLEET_{k.upper()}": str(v) for k, v in FAST_TIMINGS.items()})
    env["SPECFLEET_REDIS_DIR"] = str(tmp_path / "redis")
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shared.cli",
            "up",
            "--port",
            "0",
            "--target",
            str(tiny_pair[0]),
            "--draft",
            str(tiny_pair[1]),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in up.stdout or []], daemon=True)
    reader.start()
    try:
        printed = []
        while not any(line.startswith("specfleet: gateway at ") for line in printed):
            printed.append(lines.get(timeout=180))
        url = printed[-1].removeprefix("specfleet: gateway at ").strip()
        key_lines = [line for line in printed if line.startswith("specfleet: api key ")]
        assert len(key_lines) == 1  # dev mode prints a fresh key, before the URL
        api_key = key_lines[0].removeprefix("specfleet: api key ").strip()
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401  # every route needs a key
        children = _children(up.pid)
        assert len(children) == 4  # redis-server, celery, worker, gateway
        job = httpx.post(
            f"{url}/v1/jobs",
            json={"prompt": "def f(x):", "max_tokens": 6, "temperature": 0},
            headers={"Prefer": "wait=60", "Authorization": f"Bearer {api_key}"},
            timeout=90,
        ).json()
        assert job["status"] == "succeeded" and len(job["output"]["token_ids"]) == 6
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
        assert [pid for pid in children if _alive(pid)] == []
        assert (tmp_path / "redis" / "appendonly.aof").exists()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        reader.join(timeout=5)
        if up.stdout:
            up.stdout.close()
    rest = []
    while not lines.empty():
        rest.append(lines.get())
    assert any("curl" in line for line in printed + rest)
