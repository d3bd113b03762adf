"""The jobs API over real HTTP (uvicorn) against a real Redis; the test plays the worker where needed."""

import asyncio
import gzip
import json
import threading
import time

import httpx
import pytest
import redis

from gateway.redis_batch import MAX_IN_FLIGHT
from shared import keys
from shared.api_keys import digest
from shared.schemas import Priority
from shared.settings import ServiceSettings
from tests.helpers.gateway import ThreadedGateway
from tests.helpers.redis_fixtures import create_key, submit_job
from tests.helpers.waiting import wait_until
from workers.engine.outputs import StepOutput
from workers.worker.emitter import Emitter, Running
from workers.worker.queue_reader import QueueReader


@pytest.fixture
def http(gateway: ThreadedGateway) -> httpx.Client:
    with httpx.Client(base_url=gateway.url, timeout=10) as client:
        yield client


def test_submit_then_get(http: httpx.Client) -> None:
    response = http.post("/v1/jobs", json={"prompt": "def f(", "max_tokens": 5, "metadata": {"run": "1"}})
    assert response.status_code == 202
    job = response.json()
    assert job["status"] == "queued" and job["priority"] == "default"
    assert job["urls"]["get"].endswith(f"/v1/jobs/{job['id']}")
    assert response.headers["location"] == job["urls"]["get"]
    got = http.get(f"/v1/jobs/{job['id']}").json()
    assert got["status"] == "queued" and got["metadata"] == {"run": "1"}
    assert got["created_at"] == pytest.approx(job["created_at"])
    assert job["expires_at"] == pytest.approx(got["expires_at"])  # the submit's answer said null
    assert got["expires_at"] == pytest.approx(got["created_at"] + ServiceSettings().default_ttl_s)
    clamped = http.post("/v1/jobs", json={"prompt": "x", "ttl_s": 1e12}).json()  # at most max_ttl_s, as queued
    assert clamped["expires_at"] == pytest.approx(clamped["created_at"] + ServiceSettings().max_ttl_s)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "priority": "urgent"}, "priority"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "bogus": 1}, "bogus"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x", "stream_interval_ms": -1}, "stream_interval_ms"),
        ({"prompt": "x", "stream_interval_ms": 60_001}, "stream_interval_ms"),
        ({"prompt": "x", "top_k": 2**63}, "top_k"),
        ({"prompt": "x", "min_p": 1.5}, "min_p"),
        ({"prompt": "x", "cache_salt": ""}, "cache_salt"),
        ({"prompt": "x", "continue_final_message": True}, "continue_final_message"),  # messages only  # the engine holds it in a long: it failed a worker's step
        ({"prompt": "x", "seed": 2**64}, "seed"),  # past torch's generators: the job failed in the worker
        ({"prompt": "x", "stop": ["\n", ""]}, "stop"),  # the engine refuses it: the job failed in the worker
        ({"prompt": "x", "speculative": "magic"}, "speculative"),  # was `speculative.bool`, the union's branch
        ({"prompt": "x", "speculative": {"method": "eagle"}}, "speculative"),
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, -1]}, "prompt_token_ids.1"),
        ({"prompt": "x", "prompt_token_ids": [1]}, "body"),  # one prompt only
    ],
)
def test_schema_errors_are_422_with_the_field(
    http: httpx.Client, rclient: redis.Redis, body: dict[str, object], field: str
) -> None:
    response = http.post("/v1/jobs", json=body)
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and error["field"] == field and field in error["message"]
    assert all(rclient.xlen(keys.queue_stream(p.value)) == 0 for p in Priority)  # refused before anything is stored


def test_empty_prompt_is_422_in_the_validators_words(http: httpx.Client) -> None:
    error = http.post("/v1/jobs", json={"prompt": "", "max_tokens": 4}).json()["error"]
    assert error["message"] == "prompt: the prompt must not be empty: it gives the model nothing to continue"


def test_malformed_json_is_422_naming_the_body_and_where_it_broke(http: httpx.Client) -> None:
    response = http.post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["field"] == "body"  # not the parser's offset, as pydantic's location has it
    assert error["message"].startswith("body: not valid JSON (") and error["message"].endswith("at character 1)")


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ({"content-type": "application/x-www-form-urlencoded"},  # curl -d without -H
         "the body must be JSON, sent with Content-Type `application/json` (this request's: "
         "`application/x-www-form-urlencoded`)"),
        ({"content-type": "application/json", "content-encoding": "gzip"},
         "the body is sent with Content-Encoding `gzip`; the gateway reads bodies without one"),
    ],
)
def test_a_body_its_headers_make_unreadable_is_415_saying_which(
    http: httpx.Client, rclient: redis.Redis, headers: dict[str, str], reason: str
) -> None:
    """The body was refused as "Input should be a valid dictionary" (a form type) or "There was an error parsing
    the body" (400, gzip): the fault is in a header, and the answer names it."""
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    raw = gzip.compress(body) if headers.get("content-encoding") == "gzip" else body
    response = http.post("/v1/jobs", content=raw, headers=headers)
    assert response.status_code == 415
    field = "Content-Encoding" if "content-encoding" in headers else "body"
    assert response.json()["error"] == {"code": "invalid_request", "message": reason, "field": field}
    if field == "Content-Encoding":
        assert response.headers["accept-encoding"] == "identity"  # RFC 7694: what it takes instead
    assert all(rclient.xlen(keys.queue_stream(p.value)) == 0 for p in Priority)
    for valid in ({"content-type": "application/vnd.specfleet+json"}, {"content-type": "application/json",
                                                                        "content-encoding": "identity"}):
        assert http.post("/v1/jobs", content=body, headers=valid).status_code == 202  # JSON types stay read
    assert http.post("/v1/jobs", content=b"[]", headers={"content-type": "application/json"}).status_code == 422


@pytest.mark.parametrize(
    ("raw", "field"),
    [(b'{"prompt": "x", "temperature": NaN}', "temperature"), (b'{"prompt": "x", "ttl_s": Infinity}', "ttl_s")],
)
def test_non_finite_numbers_are_422_as_such(http: httpx.Client, rclient: redis.Redis, raw: bytes, field: str) -> None:
    """Python's JSON reads NaN and Infinity: NaN failed `le` with a message about the bound, Infinity passed."""
    response = http.post("/v1/jobs", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 422
    assert response.json()["error"] == {
        "code": "invalid_request", "message": f"{field}: Input should be a finite number", "field": field
    }
    assert all(rclient.xlen(keys.queue_stream(p.value)) == 0 for p in Priority)


def test_unknown_job_is_404_everywhere(http: httpx.Client) -> None:
    for method, path in [
        ("GET", "/v1/jobs/nope"),
        ("GET", "/v1/jobs/nope/stream"),
        ("POST", "/v1/jobs/nope/cancel"),
    ]:
        response = http.request(method, path)
        assert response.status_code == 404, path
        assert response.json()["error"]["code"] == "not_found"
    assert http.get("/v2/other").json()["error"]["code"] == "not_found"


def test_cancel_queued_then_409(http: httpx.Client, rclient: redis.Redis) -> None:
    job_id = http.post("/v1/jobs", json={"prompt": "x"}).json()["id"]
    response = http.post(f"/v1/jobs/{job_id}/cancel")
    assert response.status_code == 200
    assert response.json()["status"] == "cancelled" and response.json()["completed_at"] is not None
    again = http.post(f"/v1/jobs/{job_id}/cancel")
    assert again.status_code == 409 and again.json()["error"]["code"] == "conflict"
    assert rclient.xlen(keys.queue_stream("default")) == 0  # its queue entry is gone
    assert rclient.ttl(keys.job_hash(job_id)) > 0  # the result TTL started


def test_same_idempotency_key_same_job(http: httpx.Client, rclient: redis.Redis) -> None:
    headers = {"Idempotency-Key": "order-42"}
    first = http.post("/v1/jobs", json={"prompt": "x"}, headers=headers).json()
    second = http.post("/v1/jobs", json={"prompt": "x"}, headers=headers).json()
    other = http.post("/v1/jobs", json={"prompt": "x"}, headers={"Idempotency-Key": "order-43"}).json()
    assert first["id"] == second["id"] != other["id"]
    assert rclient.xlen(keys.queue_stream("default")) == 2


def test_idempotency_key_reused_for_another_request_is_422(http: httpx.Client, rclient: redis.Redis) -> None:
    headers = {"Idempotency-Key": "order-44"}
    first = http.post("/v1/jobs", json={"prompt": "x", "max_tokens": 8}, headers=headers)

    changed = http.post("/v1/jobs", json={"prompt": "x", "max_tokens": 9}, headers=headers)
    replay = http.post("/v1/jobs", json={"prompt": "x", "max_tokens": 8}, headers=headers)

    assert changed.status_code == 422
    error = changed.json()["error"]
    assert error["code"] == "conflict" and error["field"] == "Idempotency-Key"
    assert first.json()["id"] in error["message"]
    assert replay.status_code == 202 and replay.json()["id"] == first.json()["id"]
    assert rclient.xlen(keys.queue_stream("default")) == 1  # nothing queued by the refused request


def test_queue_limit_is_503_with_retry_after(settings: ServiceSettings, rclient: redis.Redis) -> None:
    settings.queue_limits.batch = 2
    with ThreadedGateway(settings).start() as server, httpx.Client(base_url=server.url) as http:
        codes = [
            http.post("/v1/jobs", json={"prompt": "x", "priority": "batch"}).status_code for _ in range(3)
        ]
        assert codes == [202, 202, 503]
        refused = http.post("/v1/jobs", json={"prompt": "x", "priority": "batch"})
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "queue_full"
        assert http.post("/v1/jobs", json={"prompt": "x", "priority": "interactive"}).status_code == 202


def test_prompt_beyond_context_is_413(http: httpx.Client, rclient: redis.Redis, tmp_path) -> None:  # noqa: ANN001
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    rclient.hset(keys.MODEL_INFO, mapping={"max_model_len": 64, "tokenizer_path": str(tmp_path)})
    assert http.post("/v1/jobs", json={"prompt": "a " * 30, "max_tokens": 34}).status_code == 202  # 30 + 34
    too_long = http.post("/v1/jobs", json={"prompt": "a " * 30, "max_tokens": 35})
    assert too_long.status_code == 413 and too_long.json()["error"]["field"] == "max_tokens"
    response = http.post("/v1/jobs", json={"prompt": "a " * 64, "max_tokens": 1})
    assert response.status_code == 413
    error = response.json()["error"]
    assert (
        error["code"] == "prompt_too_long" and error["field"] == "prompt" and "64 tokens" in error["message"]
    )


def test_prefer_wait_returns_the_finished_job(
    http: httpx.Client, settings: ServiceSettings, rclient: redis.Redis
) -> None:
    def play_worker() -> None:
        reader = QueueReader(rclient, settings, "w1")
        leases = wait_until(lambda: reader.pull(1), what="the job")
        running = {leases[0].job_id: Running(leases[0].job_id, leases[0].attempt, prompt_tokens=2)}
        out = StepOutput(request_id=leases[0].job_id, new_token_ids=[7, 8], new_text="hi", finished=True,
                         finish_reason="length", num_prompt_tokens=2, num_output_tokens=2, metrics={"ttft_ms": 1.0})
        Emitter(rclient, settings).emit(running, [out])

    worker = threading.Thread(target=play_worker)
    worker.start()
    started = time.monotonic()
    response = http.post("/v1/jobs", json={"prompt": "x", "max_tokens": 2}, headers={"Prefer": "wait=5"})
    worker.join()
    assert response.status_code == 200 and time.monotonic() - started < 5
    job = response.json()
    assert job["status"] == "succeeded"
    assert job["output"] == {"text": "hi", "token_ids": [7, 8], "finish_reason": "length"}
    assert job["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "cached_tokens": None}  # no prefix cache hit
    assert job["metrics"]["ttft_ms"] == 1.0


def test_prefer_wait_times_out_with_202(http: httpx.Client) -> None:
    started = time.monotonic()
    response = http.post("/v1/jobs", json={"prompt": "x"}, headers={"Prefer": "respond-async, wait=0.3"})
    assert response.status_code == 202 and response.json()["status"] == "queued"
    assert 0.3 <= time.monotonic() - started < 3


def test_health_ready_metrics(http: httpx.Client, rclient: redis.Redis, settings: ServiceSettings) -> None:
    assert http.get("/healthz").json() == {"status": "ok"}
    not_ready = http.get("/readyz")
    assert not_ready.status_code == 503 and not_ready.json()["error"]["message"] == "no worker is alive"
    rclient.zadd(keys.WORKERS_ZSET, {"w1": time.time()})
    submit_job(rclient, settings, priority="batch")
    ready = http.get("/readyz").json()
    assert ready["workers_alive"] == 1 and ready["queue_depth"]["batch"] == 1
    text = http.get("/metrics").text
    assert 'specfleet_queue_depth{priority="batch"} 1.0' in text and "specfleet_workers_alive 1.0" in text


def test_redis_down_is_503_not_500(settings: ServiceSettings) -> None:
    from shared.redis_server import free_port

    settings.redis_url = f"redis://127.0.0.1:{free_port()}/0"
    with ThreadedGateway(settings).start() as server, httpx.Client(base_url=server.url) as http:
        response = http.post("/v1/jobs", json={"prompt": "x"})
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "unavailable"
        assert http.get("/readyz").status_code == 503


def test_the_key_the_limits_and_the_submit_are_one_command(
    gateway: ThreadedGateway, http: httpx.Client, rclient: redis.Redis
) -> None:
    """A submit sends Redis ONE command, AUTH_ADMIT_SUBMIT: the key's record is read inside the script."""
    assert http.post("/v1/jobs", json={"prompt": "a", "max_tokens": 2}).status_code == 202  # scripts loaded
    record = keys.api_key_record(digest(gateway.api_key), 0)  # one partition
    marker = "end-of-the-submit"
    sent: list[str] = []  # the commands clients sent (not the scripts' own calls)
    with rclient.monitor() as monitor:
        job = http.post("/v1/jobs", json={"prompt": "b", "max_tokens": 2}).json()
        redis.Redis(connection_pool=rclient.connection_pool).echo(marker)
        while marker not in (entry := monitor.next_command())["command"]:
            if entry["client_type"] != "lua":
                sent.append(entry["command"])
    submits = [c for c in sent if c.upper().startswith("EVALSHA")]
    assert len(submits) == 1 and record in submits[0]  # the key, its limits and the job, one round trip
    assert not [c for c in sent if record in c and c not in submits], sent  # no lookup of the key of its own
    assert rclient.hget(keys.job_hash(job["id"]), "status") == "queued"


def test_concurrent_reads_share_redis_connections(gateway: ThreadedGateway, rclient: redis.Redis) -> None:
    """200 clients read a job at once: their key reads and their job reads (READ_JOB) go to Redis in batches, at
    most MAX_IN_FLIGHT of each out at once, so the gateway opens that many connections a kind at most, not one a
    request in flight (with thousands of SSE clients connecting at once, requests waiting for a pooled connection
    timed out: 503)."""
    with httpx.Client(base_url=gateway.url, timeout=10) as http:
        job_id = http.post("/v1/jobs", json={"prompt": "def f(", "max_tokens": 5}).json()["id"]
        assert http.get(f"/v1/jobs/{job_id}").status_code == 200
    connected_before = int(rclient.info("stats")["total_connections_received"])

    async def read_all() -> list[int]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30, limits=limits) as http:
            answers = await asyncio.gather(*(http.get(f"/v1/jobs/{job_id}") for _ in range(200)))
        return [answer.status_code for answer in answers]

    assert asyncio.run(read_all()) == [200] * 200
    num_new_connections = int(rclient.info("stats")["total_connections_received"]) - connected_before
    assert num_new_connections <= 2 * MAX_IN_FLIGHT  # the key reads' batcher and the job reads'


def test_urls_follow_the_host_each_client_used(gateway: ThreadedGateway) -> None:
    with httpx.Client(base_url=gateway.url, timeout=10) as http:
        for host in ("a.example", "b.example:8080", "a.example"):
            job = http.post("/v1/jobs", json={"prompt": "def f(", "max_tokens": 2}, headers={"Host": host}).json()
            assert job["urls"]["get"] == f"http://{host}/v1/jobs/{job['id']}"


def test_a_keys_jobs_are_listed_newest_first_page_by_page(
    http: httpx.Client, rclient: redis.Redis, redis_url: str
) -> None:
    """GET /v1/jobs: the calling key's jobs (not another key's), newest first, as GET /v1/jobs/{id} answers each;
    pages continue after the last id of the one before, also past a job whose record expired in between (it
    leaves the listing as a page meets it); an `after` the listing never held is a 400 naming it."""
    mine = [http.post("/v1/jobs", json={"prompt": f"p{i}", "max_tokens": 2}).json()["id"] for i in range(7)]
    other_secret = create_key(redis_url, "other")[1]
    theirs = http.post("/v1/jobs", json={"prompt": "q", "max_tokens": 2},
                       headers={"Authorization": f"Bearer {other_secret}"}).json()["id"]  # fmt: skip
    assert http.get("/v1/jobs", params={"limit": 1},
                    headers={"Authorization": f"Bearer {other_secret}"}).json()["data"][0]["id"] == theirs  # fmt: skip
    first = http.get("/v1/jobs", params={"limit": 3}).json()
    assert [job["id"] for job in first["data"]] == mine[::-1][:3] and first["has_more"] is True
    assert first["data"][0] == http.get(f"/v1/jobs/{mine[-1]}").json()
    assert (first["object"], first["first_id"], first["last_id"]) == ("list", mine[-1], mine[-3])
    rclient.delete(keys.job_hash(mine[-3]), keys.job_hash(mine[-4]))  # expired (result_ttl_s) since that page
    second = http.get("/v1/jobs", params={"limit": 3, "after": first["last_id"]}).json()
    assert [job["id"] for job in second["data"]] == [mine[2], mine[1], mine[0]] and second["has_more"] is False
    whole = http.get("/v1/jobs", params={"limit": 100}).json()
    assert [job["id"] for job in whole["data"]] == [mine[6], mine[5], mine[2], mine[1], mine[0]]
    owner = rclient.hget(keys.job_hash(mine[0]), keys.OWNER_FIELD)
    assert rclient.zrange(keys.jobs_of(owner), 0, -1) == mine[:3] + mine[5:]  # the expired two left it
    rclient.hset(keys.job_hash(mine[1]), "status", "cancelled")
    cancelled = http.get("/v1/jobs", params={"status": "cancelled"}).json()
    assert [job["id"] for job in cancelled["data"]] == [mine[1]] and not cancelled["has_more"]
    queued = http.get("/v1/jobs", params={"status": "queued", "limit": 2}).json()
    assert [job["id"] for job in queued["data"]] == [mine[6], mine[5]] and queued["has_more"]
    assert http.get("/v1/jobs", params={"status": "sleeping"}).status_code == 422
    unknown = http.get("/v1/jobs", params={"after": "nojob"})
    assert unknown.status_code == 400 and unknown.json()["error"]["field"] == "after"
    assert http.get("/v1/jobs", params={"limit": 0}).status_code == 422


def test_a_keys_listing_keeps_its_newest_jobs_only(settings: ServiceSettings, rclient: redis.Redis) -> None:
    """The listing is bounded (jobs_listed_per_key, and a TTL past its newest job's record), whatever a key
    submits; 0 keeps no listing at all."""
    server = ThreadedGateway(settings.model_copy(update={"jobs_listed_per_key": 3})).start()
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            ids = [client.post("/v1/jobs", json={"prompt": f"p{i}"}).json()["id"] for i in range(5)]
            assert [job["id"] for job in client.get("/v1/jobs").json()["data"]] == ids[:1:-1]
    finally:
        server.stop()
    index = keys.jobs_of(rclient.hget(keys.job_hash(ids[0]), keys.OWNER_FIELD))
    assert rclient.zcard(index) == 3
    assert settings.max_ttl_s + settings.result_ttl_s < rclient.ttl(index) <= keys.INFLIGHT_TTL_S + settings.result_ttl_s
    server = ThreadedGateway(settings.model_copy(update={"jobs_listed_per_key": 0})).start()
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            client.post("/v1/jobs", json={"prompt": "x"})
            assert client.get("/v1/jobs").json() == {
                "object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False
            }  # fmt: skip
    finally:
        server.stop()
