"""The CLI prints no library INFO logs (httpx: one line per request) unless --verbose; real subprocess runs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.redis_server import free_port
from tests.helpers import REPO_ROOT
from tests.helpers.gateway import ThreadedGateway

HTTPX_LINE = "HTTP Request: POST"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECFLEET_")}  # the test key is implied
    return subprocess.run(
        [sys.executable, "-m", "shared.cli", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_submit_prints_only_the_job_id(gateway: ThreadedGateway) -> None:
    proc = run_cli("submit", "def f(x):", "--max-tokens", "2", "--url", gateway.url)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.split()) == 1
    assert HTTPX_LINE not in proc.stderr and proc.stderr.strip() == ""


def test_submit_sets_any_field_of_the_job(gateway: ThreadedGateway) -> None:
    """`--set FIELD=VALUE`: a JSON value, or text; the gateway's refusal of a field is printed, not a traceback."""
    import json

    proc = run_cli("submit", "x", "--set", 'metadata={"team": "search"}', "--set", "seed=7", "--set", "priority=batch",
                   "--url", gateway.url)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    job = json.loads(run_cli("status", proc.stdout.strip(), "--url", gateway.url).stdout)
    assert job["metadata"] == {"team": "search"} and job["priority"] == "batch"  # JSON, and text
    refused = run_cli("submit", "x", "--set", "bogus=1", "--url", gateway.url)
    assert refused.returncode != 0 and "bogus" in refused.stderr and "Traceback" not in refused.stderr
    malformed = run_cli("submit", "x", "--set", "seed", "--url", gateway.url)
    assert malformed.returncode != 0 and "FIELD=VALUE" in malformed.stderr


def test_jobs_lists_the_keys_jobs_newest_first_page_by_page(gateway: ThreadedGateway) -> None:
    submitted = [run_cli("submit", f"p{i}", "--max-tokens", "2", "--url", gateway.url).stdout.strip() for i in range(3)]
    first = run_cli("jobs", "--limit", "2", "--url", gateway.url)
    assert first.returncode == 0, first.stderr
    assert [line.split()[0] for line in first.stdout.splitlines()] == submitted[:0:-1]
    assert first.stderr.strip() == f"(more: --after {submitted[1]})"
    rest = run_cli("jobs", "--after", submitted[1], "--url", gateway.url)
    assert [line.split()[:2] for line in rest.stdout.splitlines()] == [[submitted[0], "queued"]] and not rest.stderr
    assert run_cli("jobs", "--status", "succeeded", "--url", gateway.url).stdout == ""  # no worker: none ran
    assert "status" in run_cli("jobs", "--status", "asleep", "--url", gateway.url).stderr


def test_verbose_brings_the_request_lines_back(gateway: ThreadedGateway) -> None:
    proc = run_cli("--verbose", "submit", "def f(x):", "--max-tokens", "2", "--url", gateway.url)
    assert proc.returncode == 0, proc.stderr
    assert HTTPX_LINE in proc.stderr


def test_batch_submit_logs_no_requests(gateway: ThreadedGateway, tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(
        '{"custom_id": "a", "method": "POST", "url": "/v1/jobs", "body": {"prompt": "x", "max_tokens": 1}}\n'
    )
    quiet = run_cli("batch", "submit", str(source), "--url", gateway.url)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.startswith("batch_") and HTTPX_LINE not in quiet.stderr
    loud = run_cli("-v", "batch", "submit", str(source), "--url", gateway.url)
    assert loud.returncode == 0 and HTTPX_LINE in loud.stderr


@pytest.mark.parametrize("command", [["submit", "def f(x):"], ["submit", "def f(x):", "--stream"], ["status", "abc"]])
def test_a_gateway_that_does_not_answer_is_one_line_not_a_traceback(command: list[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc = run_cli(*command, "--url", url)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip() == (
        f"error: the gateway at {url} did not answer (ConnectError: [Errno 111] Connection refused); is it running? "
        "--url or $SPECFLEET_URL names it"
    )
