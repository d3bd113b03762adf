"""`specfleet up`: one command brings up Redis + a worker + the gateway; Ctrl-C stops all, no orphans."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from shared import cpu_placement
from tests.helpers import REPO_ROOT
from tests.helpers.cpus import ALLOWED, cores_of, threads_of
from tests.helpers.up_process import children_of, running_up


def test_up_serves_jobs_and_ctrl_c_leaves_no_process(tiny_pair: tuple[Path, Path], tmp_path: Path) -> None:
    with running_up(["--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1])], tmp_path) as up:
        key_lines = [line for line in up.printed if line.startswith("specfleet: api key ")]
        assert len(key_lines) == 1  # dev mode prints a key, before the URL
        assert httpx.get(f"{up.url}/v1/models", timeout=10).status_code == 401  # every route needs a key
        children = children_of(up.process.pid)
        assert len(children) == 4  # redis-server, celery, worker, gateway
        _assert_placed(children)
        job = httpx.post(
            f"{up.url}/v1/jobs",
            json={"prompt": "def f(x):", "max_tokens": 6, "temperature": 0},
            headers={"Prefer": "wait=60", "Authorization": f"Bearer {up.api_key}"},
            timeout=90,
        ).json()
        assert job["status"] == "succeeded" and len(job["output"]["token_ids"]) == 6
        up.stop_with_ctrl_c(children)
        assert (tmp_path / "redis" / "appendonly.aof").exists()
    output = up.printed + up.rest_of_output()
    assert any("curl" in line for line in output)
    hints = [line for line in output if "--stream --url" in line]  # the hints name the installed command
    assert len(hints) == 1 and "specfleet submit " in hints[0] and "python -m" not in hints[0]


def _assert_placed(children: list[int]) -> None:
    """On 2+ cores: Redis, Celery and the gateway on the I/O cores; the worker's engine thread on the others, its
    writer process and heartbeat thread on the I/O cores (shared/cpu_placement.py). One core: nothing bound."""
    placement = cpu_placement.plan(ALLOWED, 1)
    if placement is None:
        assert {cores_of(pid) for pid in children} == {ALLOWED}
        return
    role_of = {pid: _argv(pid) for pid in children}
    (worker,) = [pid for pid, argv in role_of.items() if b"worker" in argv]
    for pid in set(children) - {worker}:  # redis-server, celery (`tasks`), the gateway
        assert cores_of(pid) == placement.io_cpus, role_of[pid]
    assert cores_of(worker) == placement.engine_cpus  # its main thread: the engine's (and its torch threads')
    assert placement.io_cpus in {cores_of(worker, tid) for tid in threads_of(worker)}  # the heartbeat thread
    (writer,) = [pid for pid in children_of(worker) if b"writer_process" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert cores_of(writer) == placement.io_cpus


def test_up_starts_its_redis_again_when_it_is_killed(tiny_pair: tuple[Path, Path], tmp_path: Path) -> None:
    """The private redis-server killed: `up` starts it again on its port and data, the fleet reconnects, the job
    done before is still there and a new one runs; Ctrl-C still stops every process."""
    with running_up(["--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1])], tmp_path) as up:
        headers = {"Prefer": "wait=60", "Authorization": f"Bearer {up.api_key}"}
        body = {"prompt": "def f(x):", "max_tokens": 4, "temperature": 0}
        before = httpx.post(f"{up.url}/v1/jobs", json=body, headers=headers, timeout=90).json()
        assert before["status"] == "succeeded"
        (redis_pid,) = [pid for pid in children_of(up.process.pid) if b"redis-server" in _argv(pid)[0]]
        os.kill(redis_pid, signal.SIGKILL)
        deadline_s = time.monotonic() + 30
        while not [pid for pid in children_of(up.process.pid) if _is_redis(pid, redis_pid)]:
            assert time.monotonic() < deadline_s, "no new redis-server"
            time.sleep(0.1)
        after = _post_until_served(f"{up.url}/v1/jobs", body, headers)
        assert after["status"] == "succeeded" and len(after["output"]["token_ids"]) == 4
        kept = httpx.get(f"{up.url}/v1/jobs/{before['id']}", headers=headers, timeout=10).json()
        assert kept["status"] == "succeeded" and kept["output"] == before["output"]
        assert up.process.poll() is None
        up.stop_with_ctrl_c(children_of(up.process.pid))  # the new redis-server among them


def _argv(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return [b""]


def _is_redis(pid: int, old_pid: int) -> bool:
    return pid != old_pid and b"redis-server" in _argv(pid)[0]


def _post_until_served(url: str, body: dict[str, object], headers: dict[str, str]) -> dict[str, object]:
    """POST until the gateway answers other than 503 (its connection to the new Redis is being made)."""
    deadline_s = time.monotonic() + 60
    while True:
        response = httpx.post(url, json=body, headers=headers, timeout=90)
        if response.status_code != 503 or time.monotonic() > deadline_s:
            assert response.status_code == 200, response.text
            return dict(response.json())
        time.sleep(0.2)


def test_up_on_a_port_in_use_stops_before_starting_anything(tiny_pair: tuple[Path, Path], tmp_path: Path) -> None:
    """The gateway's port is checked first: taken, `up` had started Redis, Celery and the worker (~30 s with its
    models) before the gateway failed to bind, and said so only in uvicorn's log."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECFLEET_") and k != "REDIS_URL"}
    env["SPECFLEET_REDIS_DIR"] = str(tmp_path / "redis")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        up = subprocess.run(
            [sys.executable, "-m", "shared.cli", "up", "--port", str(port), "--target", str(tiny_pair[0]),
             "--draft", str(tiny_pair[1])],  # fmt: skip
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert up.returncode == 1
    assert f"specfleet: port {port} on 127.0.0.1 is in use (another fleet?): --port N picks another" in up.stderr
    assert not (tmp_path / "redis").exists()  # no redis-server was started
