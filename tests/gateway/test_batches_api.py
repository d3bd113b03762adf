"""/v1/batches end to end: gateway (HTTP) -> Celery expansion -> engine worker (tiny model) -> results."""

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis

from shared import keys
from shared.settings import ServiceSettings
from tests.helpers.engine_worker import EngineThread
from tests.helpers.gateway import ThreadedGateway
from tests.helpers.played_worker import PlayedWorker
from tests.helpers.tasks import CeleryWorker, Receiver
from tests.helpers.waiting import wait_until

URLS = ("/v1/completions", "/v1/chat/completions", "/v1/jobs")


@pytest.fixture
def http(hook_settings: ServiceSettings, gateway: ThreadedGateway) -> httpx.Client:
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        yield client


def request_line(i: int, url: str | None = None, max_tokens: int = 2) -> dict:
    url = url or URLS[i % 3]
    if url == "/v1/chat/completions":
        body: dict = {"messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": max_tokens}
    else:
        body = {"prompt": f"def f{i}(", "max_tokens": max_tokens}
    body.update(temperature=0)
    return {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def post_jsonl(http: httpx.Client, data: bytes, **params: str) -> httpx.Response:
    return http.post(
        "/v1/batches", content=data, params=params, headers={"content-type": "application/jsonl"}
    )


def wait_status(http: httpx.Client, batch_id: str, statuses: tuple[str, ...], timeout_s: float = 120) -> dict:
    seen: list[dict] = []

    def done() -> dict | None:
        batch = http.get(f"/v1/batches/{batch_id}").json()
        seen.append(batch["request_counts"])
        return batch if batch["status"] in statuses else None

    batch = wait_until(done, timeout_s, 0.05, f"batch {batch_id} to reach {statuses}")
    for counts in seen:  # live counts never exceed the total
        assert counts["completed"] + counts["failed"] <= counts["total"]
    return batch


def results(http: httpx.Client, batch_id: str) -> list[dict]:
    response = http.get(f"/v1/batches/{batch_id}/results")
    assert response.status_code == 200 and response.headers["content-type"].startswith("application/jsonl")
    return [json.loads(line) for line in response.text.splitlines()]


def test_a_200_line_batch_completes_with_one_result_per_custom_id(
    http: httpx.Client, celery_worker: CeleryWorker, engine_worker: EngineThread
) -> None:
    response = post_jsonl(http, jsonl([request_line(i) for i in range(200)]), metadata='{"run": "a"}')
    assert response.status_code == 202, response.text
    created = response.json()
    assert created["status"] == "validating" and created["request_counts"] == {
        "total": 200,
        "completed": 0,
        "failed": 0,
    }
    assert created["metadata"] == {"run": "a"} and response.headers["location"] == created["urls"]["get"]
    batch = wait_status(http, created["id"], ("completed", "failed", "expired", "cancelled"))
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 200, "completed": 200, "failed": 0}
    assert batch["usage"]["compute_s"] > 0  # the lines' engine time, summed (workers/worker/cost.py)
    assert batch["created_at"] <= batch["in_progress_at"] <= batch["finalizing_at"] <= batch["completed_at"]
    lines = results(http, created["id"])
    assert [line["custom_id"] for line in lines] == [f"req-{i}" for i in range(200)]
    shapes = {URLS[0]: "text_completion", URLS[1]: "chat.completion"}
    for i, line in enumerate(lines):
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        if URLS[i % 3] in shapes:
            assert body["object"] == shapes[URLS[i % 3]] and body["usage"]["completion_tokens"] == 2
        else:
            assert body["status"] == "succeeded" and body["metadata"]["custom_id"] == f"req-{i}"
    # OpenAI's token totals: the lines' usage, summed
    input_tokens = sum(line["response"]["body"]["usage"]["prompt_tokens"] for line in lines)
    output_tokens = sum(line["response"]["body"]["usage"]["completion_tokens"] for line in lines)
    assert input_tokens > 0 and output_tokens == 2 * 200
    assert {name: batch["usage"][name] for name in ("input_tokens", "output_tokens", "total_tokens")} == {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "total_tokens": input_tokens + output_tokens,
    }
    assert batch["model"] == lines[1]["response"]["body"]["model"]  # the served model ran every line
    job = http.get(f"/v1/jobs/{lines[0]['response']['request_id']}").json()
    assert job["priority"] == "batch" and job["metadata"]["batch_id"] == created["id"]


def test_a_batch_and_its_lines_name_the_model_as_the_openai_routes_do(
    http: httpx.Client, hook_settings: ServiceSettings, celery_worker: CeleryWorker, tiny_target: Path
) -> None:
    """A worker publishes its model directory's path: the OpenAI routes call the model by the directory's name,
    and so do the batch (OpenAI's `model`) and its lines' response bodies (they said the whole path)."""
    worker = EngineThread(
        hook_settings, tiny_target, worker_id="path-test", model_name=str(tiny_target), max_num_seqs=4
    ).start()
    try:
        def served() -> list[str]:
            return [model["id"] for model in http.get("/v1/models").json()["data"]]

        wait_until(lambda: served() == [tiny_target.name], 30, 0.05, "the worker's model")
        created = post_jsonl(http, jsonl([request_line(i, "/v1/chat/completions") for i in range(2)])).json()
        batch = wait_status(http, created["id"], ("completed", "failed", "expired", "cancelled"))
    finally:
        worker.stop()
    assert batch["status"] == "completed" and created["model"] == batch["model"] == tiny_target.name
    assert [line["response"]["body"]["model"] for line in results(http, created["id"])] == [tiny_target.name] * 2


def test_responses_lines_answer_response_objects(
    http: httpx.Client, celery_worker: CeleryWorker, engine_worker: EngineThread
) -> None:
    """A batch of /v1/responses lines (its file form's endpoint too): each result is the route's `response`."""
    body = {"input": "def f(", "instructions": "Write Python.", "max_output_tokens": 3, "temperature": 0, "ignore_eos": True}
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses", "body": body} for i in range(2)]
    created = post_jsonl(http, jsonl(lines)).json()
    batch = wait_status(http, created["id"], ("completed", "failed", "expired", "cancelled"))
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 2
    for result in results(http, created["id"]):
        answer = result["response"]["body"]
        job = http.get(f"/v1/jobs/{result['response']['request_id']}").json()
        assert answer["object"] == "response" and answer["status"] == "incomplete"
        assert answer["output"][0]["content"][0]["text"] == job["output"]["text"]
        assert answer["usage"]["output_tokens"] == 3 and answer["instructions"] == "Write Python."
        assert http.get(f"/v1/responses/{answer['id']}").status_code == 404  # in the batch's output, not stored


def test_a_line_whose_stored_request_does_not_validate_fails_alone(
    http: httpx.Client, hook_settings: ServiceSettings, rclient: redis.Redis, engine_worker: EngineThread,
    tmp_path: Path,
) -> None:
    """A line stored before a bound tightened (or changed in Redis): reading it raised in the expansion task,
    and the batch expanded no further until its window ended. Its job is queued as stored and fails naming the
    field; the batch completes with it counted failed."""
    created = post_jsonl(http, jsonl([request_line(i, "/v1/completions") for i in range(3)])).json()
    stored = json.loads(rclient.lindex(keys.batch_lines(created["id"]), 1))
    changed = {**stored, "request": {**stored["request"], "max_tokens": 0}}
    rclient.lset(keys.batch_lines(created["id"]), 1, json.dumps(changed))  # before any Celery worker expands it
    celery = CeleryWorker(hook_settings, tmp_path / "celery.log").start()
    try:
        batch = wait_status(http, created["id"], ("completed", "failed", "expired", "cancelled"))
    finally:
        celery.stop()
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    lines = results(http, created["id"])
    assert [line["custom_id"] for line in lines] == ["req-0", "req-1", "req-2"]
    assert lines[1]["response"] is None and lines[1]["error"]["code"] == "invalid_request"
    assert "stored request does not validate here (max_tokens" in lines[1]["error"]["message"]


def test_bad_lines_are_all_named_and_nothing_is_created(http: httpx.Client) -> None:
    lines = [
        json.dumps(request_line(0)),
        "{oops",
        json.dumps(request_line(0)),
        json.dumps({**request_line(3), "url": "/v1/x"}),
    ]
    response = post_jsonl(http, ("\n".join(lines) + "\n").encode())
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "invalid_batch" and "3 bad line" in error["message"]
    assert [(d["line"], d["code"]) for d in error["data"]] == [
        (2, "invalid_json"),
        (3, "duplicate_custom_id"),
        (4, "invalid_url"),
    ]
    assert http.get("/v1/batches").json()["data"] == []


def test_size_limits_are_413(http: httpx.Client, hook_settings: ServiceSettings) -> None:
    hook_settings.batch_max_lines = 3
    assert post_jsonl(http, jsonl([request_line(i) for i in range(4)])).status_code == 413
    hook_settings.batch_max_bytes = 200
    response = post_jsonl(http, jsonl([request_line(i) for i in range(3)]))
    assert response.status_code == 413 and response.json()["error"]["code"] == "invalid_request"
    files = {"file": ("in.jsonl", jsonl([request_line(i) for i in range(3)]) * 30)}
    assert http.post("/v1/batches", files=files).status_code == 413


def test_private_batch_webhook_is_refused(http: httpx.Client) -> None:
    response = post_jsonl(http, jsonl([request_line(0)]), webhook="http://192.168.0.10/hook")
    assert response.status_code == 422 and response.json()["error"]["field"] == "webhook"


def test_multipart_upload_and_the_batch_webhook(
    http: httpx.Client, receiver: Receiver, celery_worker: CeleryWorker, engine_worker: EngineThread
) -> None:
    files = {"file": ("in.jsonl", jsonl([request_line(i) for i in range(3)]), "application/jsonl")}
    data = {"webhook": receiver.url + "/batch", "metadata": '{"team": "x"}'}
    response = http.post("/v1/batches", files=files, data=data)
    assert response.status_code == 202, response.text
    batch_id = response.json()["id"]
    calls = receiver.wait_for(lambda cs: len(cs) == 1, what="the batch webhook")
    receiver.verify_all()
    body = calls[0].json
    assert body["id"] == batch_id and body["status"] == "completed" and body["metadata"] == {"team": "x"}
    assert calls[0].headers["webhook-id"] == f"msg_{batch_id}_completed"
    got = wait_until(
        lambda: http.get(f"/v1/batches/{batch_id}").json()["webhook_status"], what="webhook_status"
    )
    assert got["completed"]["state"] == "delivered"


def test_cancel_mid_batch_keeps_finished_results_and_cancels_the_rest(
    http: httpx.Client, hook_settings: ServiceSettings, rclient: redis.Redis, tmp_path
) -> None:  # noqa: ANN001
    hook_settings.queue_limits.batch = (
        12  # expansion stalls at 12 waiting lines: some lines never become jobs
    )
    with CeleryWorker(hook_settings, tmp_path / "celery.log").start() as celery:
        batch_id = post_jsonl(http, jsonl([request_line(i, "/v1/completions") for i in range(30)])).json()[
            "id"
        ]
        wait_until(lambda: rclient.xlen(keys.queue_stream("batch")) >= 12, what="lines queued as jobs")
        worker = PlayedWorker(rclient, hook_settings)
        urgent = http.post("/v1/jobs", json={"prompt": "now", "priority": "interactive"}).json()["id"]
        assert worker.take() == urgent  # interactive traffic overtakes the queued batch lines
        worker.emit(urgent, [1], "x", finish_reason="length")
        finished = [worker.take() for _ in range(3)]
        for job_id in finished[:2]:
            worker.emit(job_id, [7], "ok", finish_reason="length")
        wait_status(http, batch_id, ("in_progress",))
        cancelling = http.post(f"/v1/batches/{batch_id}/cancel").json()
        assert cancelling["status"] == "cancelling" and cancelling["cancelling_at"] is not None
        wait_until(
            lambda: rclient.xlen(keys.queue_stream("batch")) == 1, what="queued lines cancelled"
        )  # the running one
        assert (
            http.get(f"/v1/batches/{batch_id}").json()["status"] == "cancelling"
        )  # a running line still finishes
        worker.emit(finished[2], [8], "ok", finish_reason="length")
        batch = wait_status(http, batch_id, ("cancelled",), timeout_s=30)
        assert celery.log()
    assert batch["request_counts"] == {"total": 30, "completed": 3, "failed": 27}
    assert batch["cancelled_at"] >= batch["cancelling_at"]
    lines = results(http, batch_id)
    assert [line["custom_id"] for line in lines] == [f"req-{i}" for i in range(30)]
    done = [line for line in lines if line["response"]]
    assert sorted(line["response"]["request_id"] for line in done) == sorted(finished)
    assert all(line["response"]["body"]["choices"][0]["text"] == "ok" for line in done)
    assert {line["error"]["code"] for line in lines if not line["response"]} == {"cancelled"}
    assert any(line["id"] is None for line in lines)  # lines the stalled expansion never submitted
    again = http.post(f"/v1/batches/{batch_id}/cancel")
    assert again.status_code == 200 and again.json()["status"] == "cancelled"


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"completion_window_s": "inf"}, "completion_window_s"),  # taken: expires_at null, the batch never expired
        ({"completion_window_s": "1e308"}, "completion_window_s"),  # past max_ttl_s, which bounds its jobs
        ({"completion_window_s": "-1"}, "completion_window_s"),  # was named `metadata`
        ({"metadata": "{not json"}, "metadata"),
        ({"metadata": '{"k": 1}'}, "metadata.k"),
    ],
)
def test_bad_batch_options_name_the_option(
    http: httpx.Client, rclient: redis.Redis, params: dict[str, str], field: str
) -> None:
    response = post_jsonl(http, jsonl([request_line(0)]), **params)
    assert response.status_code in (400, 422)
    error = response.json()["error"]
    assert error["field"] == field and error["message"].startswith(f"{field}: "), error
    assert rclient.zcard(keys.BATCHES_ZSET) == 0  # nothing stored


def test_an_idempotency_key_makes_one_batch_however_often_it_is_sent(http: httpx.Client, rclient: redis.Redis) -> None:
    """A client that lost the answer and retries (the CLI, a script) made a second batch of the same lines: every
    line ran twice. Now the key's first batch answers every retry, racing ones too; another input under the same
    key is a 422 conflict naming the batch."""
    data = jsonl([request_line(i) for i in range(3)])
    first = post_jsonl_with_key(http, data, "nightly-1")
    assert first.status_code == 202
    answers: list[httpx.Response] = []
    racers = [threading.Thread(target=lambda: answers.append(post_jsonl_with_key(http, data, "nightly-2")))
              for _ in range(4)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join()
    again = post_jsonl_with_key(http, data, "nightly-1")
    assert again.status_code == 202 and again.json()["id"] == first.json()["id"]
    assert {a.status_code for a in answers} == {202} and len({a.json()["id"] for a in answers}) == 1
    assert rclient.zcard(keys.BATCHES_ZSET) == 2  # one per key
    other = post_jsonl_with_key(http, jsonl([request_line(9)]), "nightly-1")
    assert other.status_code == 422
    assert other.json()["error"]["code"] == "conflict" and other.json()["error"]["field"] == "Idempotency-Key"
    assert first.json()["id"] in other.json()["error"]["message"]
    assert post_jsonl_with_key(http, data, "nightly-1", completion_window_s="60").status_code == 422  # options too
    assert post_jsonl(http, data).json()["id"] != first.json()["id"]  # without a key: a new batch


def post_jsonl_with_key(http: httpx.Client, data: bytes, key: str, **params: str) -> httpx.Response:
    return http.post("/v1/batches", content=data, params=params,
                     headers={"content-type": "application/jsonl", "Idempotency-Key": key})


def test_list_is_paginated_newest_first_and_unknown_is_404(http: httpx.Client, rclient: redis.Redis) -> None:
    ids = [post_jsonl(http, jsonl([request_line(i)])).json()["id"] for i in range(3)]
    first = http.get("/v1/batches", params={"limit": 2}).json()
    assert [b["id"] for b in first["data"]] == ids[::-1][:2] and first["has_more"]
    second = http.get("/v1/batches", params={"limit": 2, "after": first["last_id"]}).json()
    assert [b["id"] for b in second["data"]] == [ids[0]] and not second["has_more"]
    rclient.delete(keys.batch_hash(first["last_id"]))  # that batch's record expired (its result TTL) ...
    assert [b["id"] for b in http.get("/v1/batches").json()["data"]] == [ids[2], ids[0]]  # ... and left the list
    resumed = http.get("/v1/batches", params={"limit": 2, "after": first["last_id"]}).json()
    assert [b["id"] for b in resumed["data"]] == [ids[0]]  # it restarted from the newest: ids[2] again
    unknown = http.get("/v1/batches", params={"after": "batch_nope"})
    assert unknown.status_code == 400 and unknown.json()["error"]["field"] == "after"
    for method, path in [
        ("GET", "/v1/batches/batch_nope"),
        ("GET", "/v1/batches/batch_nope/results"),
        ("POST", "/v1/batches/batch_nope/cancel"),
    ]:
        response = http.request(method, path)
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


def test_lines_whose_notices_were_lost_are_recovered(
    http: httpx.Client, hook_settings: ServiceSettings, rclient: redis.Redis, tmp_path
) -> None:  # noqa: ANN001
    with CeleryWorker(hook_settings, tmp_path / "celery-1.log").start():
        batch_id = post_jsonl(http, jsonl([request_line(i, "/v1/jobs") for i in range(3)])).json()["id"]
        wait_until(lambda: rclient.xlen(keys.queue_stream("batch")) == 3, what="the lines queued as jobs")
    worker = PlayedWorker(rclient, hook_settings)  # run the jobs while no Celery worker is up ...
    for _ in range(3):
        worker.emit(worker.take(), [1], "x", finish_reason="length")
    rclient.xtrim(keys.OUTBOX_STREAM, maxlen=0)  # ... and lose their notices
    with CeleryWorker(hook_settings, tmp_path / "celery-2.log").start() as celery:
        batch = wait_status(http, batch_id, ("completed",), timeout_s=30)
        assert "recovered without their notice" in celery.log()
    assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert len(results(http, batch_id)) == 3


def test_lines_not_started_within_the_window_expire_the_batch(
    http: httpx.Client, hook_settings: ServiceSettings, rclient: redis.Redis, celery_worker: CeleryWorker
) -> None:
    created = post_jsonl(
        http, jsonl([request_line(i, "/v1/jobs") for i in range(2)]), completion_window_s="0.2"
    )
    batch_id = created.json()["id"]
    wait_until(lambda: rclient.xlen(keys.queue_stream("batch")) == 2, what="the lines queued as jobs")
    wait_until(
        lambda: time.time() > created.json()["expires_at"] + 0.01, what="the completion window to pass"
    )
    assert PlayedWorker(rclient, hook_settings).reader.pull(5) == []  # a worker finds them expired
    batch = wait_status(http, batch_id, ("expired",), timeout_s=30)
    assert batch["request_counts"] == {"total": 2, "completed": 0, "failed": 2}
    assert batch["expired_at"] is not None and batch["finalizing_at"] is not None
    assert {line["error"]["code"] for line in results(http, batch_id)} == {"expired"}
