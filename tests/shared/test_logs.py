"""Structured logs (settings.log_json): the formatter's fields and masking, and a real `specfleet gateway`
process whose request lines carry the job id and the API key's name, never the key."""

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from shared import logs
from shared.redis_server import free_port
from tests.helpers import REPO_ROOT
from tests.helpers.redis_fixtures import create_key
from tests.helpers.waiting import wait_until


def format_json(message: str, *args: object, **extra: object) -> dict:
    record = logging.LogRecord("specfleet.test", logging.WARNING, __file__, 1, message, args, None)
    for name, value in extra.items():
        setattr(record, name, value)
    logs.ContextFilter().filter(record)
    return json.loads(logs.JsonFormatter().format(record))


def test_records_carry_the_bound_job_and_key_name_and_mask_secrets() -> None:
    with logs.bound(job_id="job_1", key_name="ops"):
        doc = format_json("retrying with %s and whsec_%s", "sf-" + "A" * 43, "B" * 30)
    assert doc["job_id"] == "job_1" and doc["key_name"] == "ops"
    assert doc["message"] == "retrying with sf-*** and whsec_***"
    assert set(doc) == {"ts", "level", "logger", "message", "job_id", "key_name"}
    assert "job_id" not in format_json("outside any job")  # the binding ended with the block
    assert format_json("x", job_id="job_2")["job_id"] == "job_2"  # extra= wins


def test_gateway_json_logs_name_job_and_key_never_the_secret(redis_url: str, tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECFLEET_")}
    env.update({"REDIS_URL": redis_url, "SPECFLEET_LOG_JSON": "true"})
    log_path = tmp_path / "gateway.log"
    args = [sys.executable, "-m", "shared.cli", "gateway", "--port", str(port)]
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    secret = create_key(redis_url, "ops-team")[1]
    try:
        wait_until(lambda: proc.poll() is not None or b"Application startup complete" in log_path.read_bytes(),
                   timeout_s=60, what="the gateway to start")
        assert proc.poll() is None, log_path.read_text()
        headers = {"Authorization": f"Bearer {secret}"}
        job_id = httpx.post(f"{url}/v1/jobs", headers=headers, json={"prompt": "x"}, timeout=10).json()["id"]
        assert httpx.get(f"{url}/v1/jobs/{job_id}", headers=headers, timeout=10).status_code == 200
        assert httpx.get(f"{url}/v1/jobs/{job_id}", headers={"Authorization": "Bearer " + secret[:-1] + "x"},
                         timeout=10).status_code == 401

        def request_lines() -> list[dict]:
            lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
            return [d for d in lines if d["logger"] == "uvicorn.access" and "/v1/jobs" in d["message"]]

        submit, read, refused = wait_until(lambda: len(request_lines()) == 3 and request_lines(),
                                           what="three request lines")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    assert "POST /v1/jobs" in submit["message"] and submit["key_name"] == "ops-team"
    assert submit["job_id"] == job_id and read["job_id"] == job_id and read["key_name"] == "ops-team"
    assert "key_name" not in refused  # an unknown key has no name
    text = log_path.read_text()
    assert secret not in text and secret[3:20] not in text  # every line is JSON; no key material anywhere
    assert all(json.loads(line)["level"] for line in text.splitlines() if line.strip())
