"""API keys and tenants over real HTTP: 401 without a valid key, others' jobs are 404, revocation is immediate,
admin-only stats, production refuses to start without keys, the key management CLI, and no key in any log."""

import asyncio
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from gateway.main import create_app
from shared import keys
from shared.api_keys import KeyRegistry, digest
from shared.settings import ServiceSettings
from tests.helpers.gateway import ThreadedGateway
from tests.helpers.redis_fixtures import create_key
from tests.helpers.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bare(settings: ServiceSettings) -> Iterator[ThreadedGateway]:
    """The gateway exactly as deployed: no default key."""
    with ThreadedGateway(settings, default_key=False).start() as server:
        yield server


def _as(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def test_every_route_but_health_needs_a_valid_key(bare: ThreadedGateway, redis_url: str) -> None:
    with httpx.Client(base_url=bare.url) as http:
        assert http.get("/healthz").status_code == 200
        for method, path in [
            ("POST", "/v1/jobs"),
            ("GET", "/v1/jobs/abc"),
            ("POST", "/v1/jobs/abc/cancel"),
            ("GET", "/v1/batches"),
            ("GET", "/metrics"),
            ("GET", "/v1/models"),
            ("POST", "/v1/completions"),
        ]:
            for headers in ({}, _as("sf-not-a-key"), {"Authorization": "Basic dXNlcjpwdw=="}):
                response = http.request(method, path, headers=headers, json={"prompt": "x"})
                assert response.status_code == 401, (method, path, headers)
                assert response.headers["www-authenticate"] == "Bearer"
                error = response.json()["error"]
                assert (
                    error["code"] in ("unauthorized", "invalid_api_key")
                    or error.get("type") == "authentication_error"
                )
        assert (
            http.post("/v1/jobs", json={"prompt": "x"}, headers=_as(create_key(redis_url)[1])).status_code
            == 202
        )


def test_a_tenant_sees_and_cancels_only_its_own_jobs(bare: ThreadedGateway, redis_url: str) -> None:
    alice, bob = create_key(redis_url, "alice")[1], create_key(redis_url, "bob")[1]
    admin = create_key(redis_url, "ops", is_admin=True)[1]
    with httpx.Client(base_url=bare.url) as http:
        job_id = http.post("/v1/jobs", json={"prompt": "x"}, headers=_as(alice)).json()["id"]
        for method, path in [
            ("GET", f"/v1/jobs/{job_id}"),
            ("GET", f"/v1/jobs/{job_id}/stream"),
            ("POST", f"/v1/jobs/{job_id}/cancel"),
        ]:
            theirs = http.request(method, path, headers=_as(bob))
            unknown = http.request(method, path.replace(job_id, "0" * 32), headers=_as(bob))
            assert (
                theirs.status_code == unknown.status_code == 404
            )  # never 403: the id's existence stays hidden
            assert theirs.json()["error"]["code"] == "not_found"
        assert http.get(f"/v1/jobs/{job_id}", headers=_as(alice)).json()["status"] == "queued"
        assert http.get(f"/v1/jobs/{job_id}", headers=_as(admin)).status_code == 200  # admin sees every job
        assert http.post(f"/v1/jobs/{job_id}/cancel", headers=_as(alice)).json()["status"] == "cancelled"
        # the same Idempotency-Key from two tenants makes two jobs
        same = {"Idempotency-Key": "order-1"}
        first = http.post("/v1/jobs", json={"prompt": "x"}, headers={**_as(alice), **same}).json()["id"]
        second = http.post("/v1/jobs", json={"prompt": "x"}, headers={**_as(bob), **same}).json()["id"]
        again = http.post("/v1/jobs", json={"prompt": "x"}, headers={**_as(alice), **same}).json()["id"]
        assert first == again != second


def test_a_revoked_key_is_refused_at_once(
    bare: ThreadedGateway, redis_url: str, rclient: redis.Redis
) -> None:
    key, secret = create_key(redis_url, "leaving")
    with httpx.Client(base_url=bare.url, headers=_as(secret)) as http:
        assert http.post("/v1/jobs", json={"prompt": "x"}).status_code == 202
        assert KeyRegistry(rclient).revoke(key.id)
        refused = http.post("/v1/jobs", json={"prompt": "x"})
        assert refused.status_code == 401 and "revoked" in refused.json()["error"]["message"]


def test_a_submit_refused_for_its_body_still_answers_401_to_an_unknown_or_revoked_key(
    bare: ThreadedGateway, redis_url: str, rclient: redis.Redis
) -> None:
    """The submit routes read the key inside the submit's script call; a request refused before that call (its
    body, its size, its key's token limit) checks the key first, so a bad key is a 401 wherever it fails."""
    revoked, revoked_secret = create_key(redis_url, "gone", tokens_per_min=10)
    KeyRegistry(rclient).revoke(revoked.id)
    unknown_secret = "sf-" + "x" * 43  # well-formed, never created
    refusals = [
        ("/v1/jobs", {"prompt": "x", "max_tokens": -1}),  # 422: invalid body
        ("/v1/jobs", {"prompt": "x" * 300_000}),  # 413: beyond max_prompt_chars
        ("/v1/jobs", {"prompt": "x", "max_tokens": 64}),  # 413: beyond the revoked key's token limit
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}),  # 400 in OpenAI's shape
        ("/v1/chat/completions", {"messages": "not a list"}),
    ]
    with httpx.Client(base_url=bare.url, timeout=30) as http:
        for secret, message in ((unknown_secret, "invalid API key"), (revoked_secret, "this API key was revoked")):
            for path, body in refusals:
                response = http.post(path, json=body, headers=_as(secret))
                assert response.status_code == 401, (path, body, response.text[:200])
                assert response.headers["www-authenticate"] == "Bearer"
                assert response.json()["error"]["message"] == message
        # a valid key gets the refusal itself
        valid = _as(create_key(redis_url, "ok", tokens_per_min=10)[1])
        assert http.post("/v1/jobs", json=refusals[0][1], headers=valid).status_code == 422
        too_big = http.post("/v1/jobs", json=refusals[2][1], headers=valid)
        assert too_big.status_code == 413 and "more than this key's limit of 10 tokens" in too_big.json()["error"]["message"]
        assert http.post("/v1/completions", json=refusals[3][1], headers=valid).status_code == 400


def test_fleet_stats_need_an_admin_key(bare: ThreadedGateway, redis_url: str) -> None:
    with httpx.Client(base_url=bare.url) as http:
        tenant = http.get("/metrics", headers=_as(create_key(redis_url)[1]))
        assert tenant.status_code == 403 and tenant.json()["error"]["code"] == "forbidden"
        admin = http.get("/metrics", headers=_as(create_key(redis_url, is_admin=True)[1]))
        assert admin.status_code == 200 and "specfleet_queue_depth" in admin.text


def test_production_refuses_to_start_without_a_key(settings: ServiceSettings, redis_url: str) -> None:
    prod = settings.model_copy(update={"env": "prod"})

    async def start_and_stop() -> None:
        app = create_app(prod)
        async with app.router.lifespan_context(app):
            pass

    with pytest.raises(RuntimeError, match="no active API key"):
        asyncio.run(start_and_stop())
    key, _ = create_key(redis_url)
    asyncio.run(start_and_stop())  # starts once a key exists
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    KeyRegistry(client).revoke(key.id)
    client.close()
    with pytest.raises(RuntimeError, match="no active API key"):
        asyncio.run(start_and_stop())


def _cli(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "REDIS_URL": redis_url}
    return subprocess.run(
        [sys.executable, "-m", "shared.cli", "keys", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_keys_cli_stores_only_a_hash(redis_url: str, rclient: redis.Redis) -> None:
    created = _cli(
        redis_url, "create", "acme", "--requests-per-min", "5", "--max-concurrent-jobs", "2", "--json"
    )
    assert created.returncode == 0, created.stderr
    made = json.loads(created.stdout)
    secret = made["key"]
    assert secret.startswith("sf-") and made["requests_per_min"] == 5 and made["max_concurrent_jobs"] == 2
    dump = json.dumps({k: rclient.type(k) == "hash" and rclient.hgetall(k) for k in rclient.keys("*")})
    assert secret not in dump and digest(secret) in dump  # only the SHA-256 is stored
    listed = _cli(redis_url, "list", "--json")
    assert [k["name"] for k in json.loads(listed.stdout)] == ["acme"] and secret not in listed.stdout
    assert _cli(redis_url, "revoke", made["id"]).returncode == 0
    assert json.loads(_cli(redis_url, "list", "--json").stdout)[0]["revoked_at"] is not None
    assert _cli(redis_url, "revoke", "key_nope").returncode == 1


def test_no_key_material_in_logs(
    bare: ThreadedGateway, redis_url: str, rclient: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    key, secret = create_key(redis_url, "careful")
    revoked, revoked_secret = create_key(redis_url, "gone")
    KeyRegistry(rclient).revoke(revoked.id)
    with httpx.Client(base_url=bare.url) as http:
        http.post("/v1/jobs", json={"prompt": "x"}, headers=_as(secret))
        http.post("/v1/completions", json={"prompt": 1}, headers=_as(secret))
        http.get("/v1/jobs/nope", headers=_as(revoked_secret))
        http.get("/v1/models", headers=_as(secret + "x"))
        http.get("/metrics", headers=_as(secret))
    logged = "\n".join(f"{r.getMessage()} {r.args!r}" for r in caplog.records)
    assert "revoked key " + revoked.id in logged  # the id is logged (so the log above was captured) ...
    for material in (secret, revoked_secret, digest(secret), digest(revoked_secret), secret[3:20]):
        assert material not in logged  # ... never a secret or its hash


def test_a_tenant_sees_and_cancels_only_its_own_batches(
    bare: ThreadedGateway, redis_url: str, rclient: redis.Redis
) -> None:
    alice_key, alice = create_key(redis_url, "alice")
    bob = create_key(redis_url, "bob")[1]
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": "x", "max_tokens": 2},
    }
    with httpx.Client(base_url=bare.url) as http:
        created = http.post(
            "/v1/batches",
            content=json.dumps(line).encode(),
            headers={**_as(alice), "content-type": "application/jsonl"},
        )
        assert created.status_code == 202
        batch_id = created.json()["id"]
        for method, path in [
            ("GET", f"/v1/batches/{batch_id}"),
            ("GET", f"/v1/batches/{batch_id}/results"),
            ("POST", f"/v1/batches/{batch_id}/cancel"),
        ]:
            assert http.request(method, path, headers=_as(bob)).status_code == 404
        assert http.get("/v1/batches", headers=_as(bob)).json()["data"] == []
        assert [b["id"] for b in http.get("/v1/batches", headers=_as(alice)).json()["data"]] == [batch_id]
        assert http.get(f"/v1/batches/{batch_id}", headers=_as(alice)).status_code == 200
    # the batch's line jobs are submitted (by the Celery side) as the batch's owner's
    assert rclient.hget(keys.batch_hash(batch_id), keys.OWNER_FIELD) == alice_key.id


def test_a_batch_lines_jobs_belong_to_its_owner(
    hook_settings: ServiceSettings, celery_worker: object, redis_url: str, rclient: redis.Redis
) -> None:
    owner, secret = create_key(redis_url, "batcher")
    other = create_key(redis_url, "other")[1]
    line = {"custom_id": "a", "method": "POST", "url": "/v1/jobs", "body": {"prompt": "x", "max_tokens": 2}}
    with (
        ThreadedGateway(hook_settings, default_key=False).start() as server,
        httpx.Client(base_url=server.url) as http,
    ):
        batch_id = http.post(
            "/v1/batches",
            content=json.dumps(line).encode(),
            headers={**_as(secret), "content-type": "application/jsonl"},
        ).json()["id"]
        job_id = wait_until(lambda: rclient.hget(keys.batch_jobs(batch_id), "0"), what="the line's job")
        assert rclient.hget(keys.job_hash(job_id), keys.OWNER_FIELD) == owner.id
        assert http.get(f"/v1/jobs/{job_id}", headers=_as(secret)).status_code == 200
        assert http.get(f"/v1/jobs/{job_id}", headers=_as(other)).status_code == 404


def test_the_schema_documents_the_bearer_scheme_and_401_everywhere(bare: ThreadedGateway) -> None:
    schema = httpx.get(f"{bare.url}/openapi.json").json()  # the schema itself is public, like /docs
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    for path, methods in schema["paths"].items():
        if path in ("/healthz", "/readyz"):
            continue
        for method, operation in methods.items():  # found by schemathesis: /metrics had no 401 documented
            assert "401" in operation["responses"], (method, path)
            assert operation.get("security") == [{"HTTPBearer": []}], (method, path)
