"""Schemathesis against the gateway's own OpenAPI schema, with a valid key and a real worker (tiny pair): every
operation, a fixed number of examples each (bounded for CI's 2 cores), zero 5xx and no answer that breaks the
schema (status codes, content types, bodies). Failing cases it found are regular tests in test_hardening.py."""

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared import keys
from shared.settings import ServiceSettings
from tests.helpers.engine_worker import EngineThread
from tests.helpers.gateway import ThreadedGateway
from tests.helpers.redis_fixtures import create_key
from tests.helpers.waiting import wait_until

CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
)
EXAMPLES_PER_OPERATION = int(os.environ.get("SPECFLEET_SCHEMATHESIS_EXAMPLES", "25"))


@pytest.fixture
def fuzzed(engine_thread: EngineThread, settings: ServiceSettings) -> Iterator[ThreadedGateway]:
    settings.max_wait_s = 0.5  # `Prefer: wait=N` from the fuzzer must not hold the run
    settings.max_tokens_limit = 32  # jobs it makes stay short on the tiny model
    with ThreadedGateway(settings, default_key=False).start() as server:
        wait_until(
            lambda: engine_thread.client.hget(keys.MODEL_INFO, "model"), what="the worker's model info"
        )
        yield server


@pytest.mark.timeout(420)
def test_schemathesis_finds_no_server_error_or_schema_violation(
    fuzzed: ThreadedGateway, redis_url: str, tmp_path: Path
) -> None:
    secret = create_key(redis_url, "schemathesis", is_admin=True)[1]
    args = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"{fuzzed.url}/openapi.json",
        "--header",
        f"Authorization: Bearer {secret}",
        "--checks",
        ",".join(CHECKS),
        "--max-examples",
        str(EXAMPLES_PER_OPERATION),
        "--seed",
        "1",
        "--workers",
        "1",
        "--request-timeout",
        "30",
        "--phases",
        "examples,coverage,fuzzing",
        "--no-shrink",
        "--warnings",
        "off",
    ]
    run = subprocess.run(args, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-12000:] + run.stderr[-4000:]
    assert "No issues found" in run.stdout
