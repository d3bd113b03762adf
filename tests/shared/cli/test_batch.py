"""`specfleet batch ...` as a user runs it: a real process against the real gateway, Celery and engine."""

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from shared.settings import ServiceSettings
from tests.helpers import REPO_ROOT
from tests.helpers.engine_worker import EngineThread
from tests.helpers.gateway import ThreadedGateway
from tests.helpers.tasks import CeleryWorker, settings_env
from tests.helpers.waiting import wait_until


def cli(settings: ServiceSettings, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shared.cli", "batch", *args],
        cwd=REPO_ROOT,
        env=settings_env(settings),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def write_input(path: Path, prompts: list[str]) -> Path:
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": p, "max_tokens": 3, "temperature": 0},
        }
        for i, p in enumerate(prompts)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_submit_waits_with_progress_and_writes_results(
    hook_settings: ServiceSettings,
    gateway: ThreadedGateway,
    celery_worker: CeleryWorker,
    engine_worker: EngineThread,
    tmp_path: Path,
) -> None:
    source = write_input(tmp_path / "in.jsonl", [f"def f{i}(" for i in range(20)])
    out = tmp_path / "out.jsonl"
    done = cli(hook_settings, "submit", str(source), "--wait", "-o", str(out), "--url", gateway.url)
    assert done.returncode == 0, done.stderr
    batch_id = done.stdout.split()[0]
    assert (
        "20/20" in done.stderr
        and "ok=20" in done.stderr
        and "completed: 20 completed, 0 failed of 20" in done.stderr
    )
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [f"c{i}" for i in range(20)]
    assert all(r["response"]["body"]["object"] == "text_completion" for r in results)
    listed = cli(hook_settings, "list", "--url", gateway.url)
    assert listed.returncode == 0 and batch_id in listed.stdout and "completed" in listed.stdout
    status = cli(hook_settings, "status", batch_id, "--url", gateway.url)
    assert json.loads(status.stdout)["request_counts"]["completed"] == 20
    again = cli(hook_settings, "results", batch_id, "--url", gateway.url)
    assert again.stdout == out.read_text()


def test_a_failed_batch_exits_non_zero(
    hook_settings: ServiceSettings,
    gateway: ThreadedGateway,
    celery_worker: CeleryWorker,
    engine_worker: EngineThread,
    tmp_path: Path,
) -> None:
    source = write_input(tmp_path / "in.jsonl", ["x " * 2000, "y " * 2000])  # beyond the tiny model's context
    done = cli(hook_settings, "submit", str(source), "--wait", "--url", gateway.url)
    assert done.returncode == 1 and "failed: 0 completed, 2 failed of 2" in done.stderr


def test_bad_file_names_every_bad_line(
    hook_settings: ServiceSettings, gateway: ThreadedGateway, tmp_path: Path
) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"custom_id": "a"}\nnot json\n')
    done = cli(hook_settings, "submit", str(source), "--url", gateway.url)
    assert done.returncode == 1
    assert "line 1: invalid_method" in done.stderr and "line 2: invalid_json" in done.stderr


class AnswerDroppingProxy:
    """A TCP proxy to the gateway that forwards the first connection's request and closes it when the answer
    starts, without passing it on (the client sees the connection fail after the gateway acted); later connections
    pass through."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.num_connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.num_connections += 1
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            drop = self.num_connections == 1
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, drop), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, drop: bool) -> None:
        try:
            while chunk := source.recv(65536):
                if drop:
                    break
                sink.sendall(chunk)
        except OSError:
            pass
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()

    def close(self) -> None:
        self.listener.close()


def test_a_submit_whose_answer_was_lost_makes_one_batch(
    hook_settings: ServiceSettings, gateway: ThreadedGateway, tmp_path: Path
) -> None:
    """The gateway made the batch, the answer never came: the CLI sends the file again with the same
    Idempotency-Key and prints the batch the first request made (it made a second one: every line ran twice)."""
    source = write_input(tmp_path / "in.jsonl", ["a", "b"])
    proxy = AnswerDroppingProxy(int(gateway.url.rsplit(":", 1)[1]))
    try:
        done = cli(hook_settings, "submit", str(source), "--url", f"http://127.0.0.1:{proxy.port}")
    finally:
        proxy.close()
    assert done.returncode == 0, done.stderr
    assert proxy.num_connections == 2  # the answer of the first was dropped
    listed = httpx.get(f"{gateway.url}/v1/batches").json()["data"]
    assert [b["id"] for b in listed] == [done.stdout.strip()]


def test_ctrl_c_leaves_the_batch_running(
    hook_settings: ServiceSettings, gateway: ThreadedGateway, tmp_path: Path
) -> None:
    source = write_input(tmp_path / "in.jsonl", ["def f("])  # no Celery worker: it stays validating
    process = subprocess.Popen(
        [sys.executable, "-m", "shared.cli", "batch", "submit", str(source), "--wait", "--url", gateway.url],
        cwd=REPO_ROOT,
        env=settings_env(hook_settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    batch_id = process.stdout.readline().strip()  # printed before watching starts
    with httpx.Client(base_url=gateway.url) as http:
        wait_until(lambda: http.get(f"/v1/batches/{batch_id}").status_code == 200, what="the batch")
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
        assert process.returncode == 130
        assert f"specfleet batch status {batch_id} --wait" in stderr
        assert http.get(f"/v1/batches/{batch_id}").json()["status"] == "validating"
        cancel = cli(hook_settings, "cancel", batch_id, "--url", gateway.url)
        assert cancel.returncode == 0 and cancel.stdout.strip() == "cancelling"
