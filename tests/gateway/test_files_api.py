"""OpenAI's Files + Batches workflow with the real `openai` client: upload a JSONL file, create a batch from it,
poll, download its output and error files; per tenant, with clear 4xx answers. Real gateway (uvicorn), Redis,
Celery and engine worker (tiny random model)."""

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis

from shared import keys
from shared.settings import ServiceSettings
from tests.helpers.engine_worker import EngineThread
from tests.helpers.gateway import ThreadedGateway
from tests.helpers.redis_fixtures import create_key
from tests.helpers.tasks import CeleryWorker
from tests.helpers.waiting import wait_until

CHAT = "/v1/chat/completions"


def chat_line(i: int, max_tokens: int = 3) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": max_tokens}
    return {"custom_id": f"req-{i}", "method": "POST", "url": CHAT, "body": {**body, "temperature": 0}}


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


@pytest.fixture
def served(hook_settings: ServiceSettings) -> Iterator[ThreadedGateway]:
    with ThreadedGateway(hook_settings, default_key=False).start() as server:
        yield server


def tenant_client(server: ThreadedGateway, settings: ServiceSettings, name: str) -> openai.OpenAI:
    assert settings.redis_url is not None
    secret = create_key(settings.redis_url, name)[1]
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=secret, max_retries=0, timeout=60)


@pytest.fixture
def alice(served: ThreadedGateway, hook_settings: ServiceSettings) -> Iterator[openai.OpenAI]:
    with tenant_client(served, hook_settings, "alice") as client:
        yield client


@pytest.fixture
def bob(served: ThreadedGateway, hook_settings: ServiceSettings) -> Iterator[openai.OpenAI]:
    with tenant_client(served, hook_settings, "bob") as client:
        yield client


def test_the_openai_batch_workflow_runs_unchanged(
    alice: openai.OpenAI, celery_worker: CeleryWorker, engine_worker: EngineThread
) -> None:
    lines = [chat_line(i) for i in range(4)]
    lines.append(chat_line(4, max_tokens=1_000_000))  # past the tiny model's context: the worker refuses it
    uploaded = alice.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines)) and uploaded.id.startswith("file-")
    assert alice.files.retrieve(uploaded.id).filename == "requests.jsonl"
    assert alice.files.content(uploaded.id).content == jsonl(lines)

    created = alice.batches.create(
        input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h", metadata={"run": "files"}
    )
    assert created.input_file_id == uploaded.id and created.endpoint == CHAT
    assert created.completion_window == "24h" and created.metadata == {"run": "files"}
    assert created.output_file_id is None  # not before it ends
    wait_until(lambda: [m.id for m in alice.models.list()] == ["tiny"], 30, 0.1, "the worker to say its model")
    other_model = alice.files.create(file=("m.jsonl", jsonl([chat_line(0), {**chat_line(1), "body": {
        **chat_line(1)["body"], "model": "gpt-4"}}])), purpose="batch")
    with pytest.raises(openai.UnprocessableEntityError) as unserved:  # it ran on tiny, its result saying gpt-4
        alice.batches.create(input_file_id=other_model.id, endpoint=CHAT, completion_window="24h")
    assert unserved.value.body["data"] == [  # type: ignore[index]
        {"line": 2, "code": "model_not_found", "message": "the model `gpt-4` does not exist; this fleet serves `tiny`"}
    ]
    alice.files.delete(other_model.id)

    def ended() -> openai.types.Batch | None:
        batch = alice.batches.retrieve(created.id)
        return batch if batch.status in ("completed", "failed", "expired", "cancelled") else None

    batch = wait_until(ended, 120, 0.1, "the batch to end")
    assert batch.status == "completed" and batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (4, 1)
    assert batch.output_file_id and batch.error_file_id

    output = [json.loads(line) for line in alice.files.content(batch.output_file_id).text.splitlines()]
    assert [line["custom_id"] for line in output] == [f"req-{i}" for i in range(4)]
    for line in output:
        body = line["response"]["body"]
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 3
    errors = [json.loads(line) for line in alice.files.content(batch.error_file_id).text.splitlines()]
    assert [line["custom_id"] for line in errors] == ["req-4"] and errors[0]["response"] is None
    assert errors[0]["error"]["code"] == "prompt_too_long"
    described = alice.files.retrieve(batch.output_file_id)
    assert described.purpose == "batch_output"
    assert described.bytes == len(alice.files.content(batch.output_file_id).content)

    assert alice.files.delete(uploaded.id).deleted  # the batch keeps its lines and results
    assert alice.files.content(batch.output_file_id).text
    # listed as OpenAI lists them (they were not), newest first, sized; deleted as uploads are (it was a 409)
    results = [batch.error_file_id, batch.output_file_id]
    assert {f.id for f in alice.files.list()} == set(results)  # listed by the script that ended the batch
    listed = alice.files.list(purpose="batch_output").data  # one time (the batch's end): by id, descending
    assert [f.id for f in listed] == [batch.output_file_id, batch.error_file_id]
    assert [f.model_dump() for f in listed] == [alice.files.retrieve(f.id).model_dump() for f in listed]
    assert [f.id for f in alice.files.list(purpose="batch")] == []
    assert alice.files.delete(batch.output_file_id).deleted
    with pytest.raises(openai.NotFoundError):
        alice.files.content(batch.output_file_id)
    with pytest.raises(openai.NotFoundError):
        alice.files.delete(batch.output_file_id)
    assert [f.id for f in alice.files.list()] == [batch.error_file_id]
    assert alice.batches.retrieve(batch.id).output_file_id == batch.output_file_id  # the batch still names it
    assert len(httpx.get(f"{alice.base_url}batches/{batch.id}/results",
                         headers={"Authorization": f"Bearer {alice.api_key}"}).text.splitlines()) == 5  # fmt: skip


def test_files_are_per_tenant(alice: openai.OpenAI, bob: openai.OpenAI) -> None:
    mine = alice.files.create(file=("a.jsonl", jsonl([chat_line(0)])), purpose="batch")
    theirs = bob.files.create(file=("b.jsonl", jsonl([chat_line(1)])), purpose="batch")
    assert [f.id for f in alice.files.list().data] == [mine.id]
    assert [f.id for f in bob.files.list().data] == [theirs.id]
    second = alice.files.create(file=("c.jsonl", jsonl([chat_line(2)])), purpose="batch")
    assert [f.id for f in alice.files.list(purpose="batch")] == [second.id, mine.id]
    other = alice.files.list(purpose="fine-tune", limit=1)  # it said has_more with no data, and no last_id to go on
    assert other.data == [] and not other.has_more
    for call in (
        lambda: bob.files.retrieve(mine.id),
        lambda: bob.files.content(mine.id),
        lambda: bob.files.delete(mine.id),
        lambda: bob.batches.create(input_file_id=mine.id, endpoint=CHAT, completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert alice.files.retrieve(mine.id).id == mine.id  # still there


def test_a_batch_body_naming_a_file_is_read_as_such_whatever_its_content_type(
    alice: openai.OpenAI, served: ThreadedGateway
) -> None:
    """`curl -d '{"input_file_id": ...}'` sends a form type: the body was read as a one-line JSONL batch
    ("unknown fields: input_file_id")."""
    uploaded = alice.files.create(file=("a.jsonl", jsonl([chat_line(0)])), purpose="batch")
    body = {"input_file_id": uploaded.id, "endpoint": CHAT, "completion_window": "24h"}
    created = httpx.post(
        f"{served.url}/v1/batches",
        content=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {alice.api_key}", "content-type": "application/x-www-form-urlencoded"},
    )
    assert created.status_code == 202, created.text
    assert created.json()["input_file_id"] == uploaded.id and created.json()["request_counts"]["total"] == 1


def test_the_file_quota_counts_no_file_of_an_expired_batch(hook_settings: ServiceSettings) -> None:
    """A batch's files count toward file_max_per_key; those of a batch that expired since (a listing drops them
    only as its pages meet them) are dropped when the key reaches its quota, not counted against it."""
    assert hook_settings.redis_url is not None
    record, secret = create_key(hook_settings.redis_url, "quota")
    settings = hook_settings.model_copy(update={"file_max_per_key": 2})
    upload = {"file": ("a.jsonl", jsonl([chat_line(0)]), "application/jsonl")}
    client = redis.Redis.from_url(hook_settings.redis_url, decode_responses=True)
    with ThreadedGateway(settings, default_key=False).start() as server, httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {secret}"}
    ) as http:
        assert http.post("/v1/files", files=upload, data={"purpose": "batch"}).status_code == 200
        client.hset(keys.batch_hash("batch_live"), mapping={"id": "batch_live", "status": "completed"})
        client.zadd(keys.files_of(record.id), {"file-batch_gone-output": 1.0, "file-batch_live-errors": 2.0})
        assert http.post("/v1/files", files=upload, data={"purpose": "batch"}).status_code == 409  # 3 of 2
        client.delete(keys.batch_hash("batch_live"))  # expired: its file no longer counts
        assert http.post("/v1/files", files=upload, data={"purpose": "batch"}).status_code == 200
        assert client.zcard(keys.files_of(record.id)) == 2  # the two uploads
    client.close()


def test_a_listing_continues_after_a_file_deleted_between_its_pages(
    alice: openai.OpenAI, served: ThreadedGateway
) -> None:
    """The openai client pages with `after` = the last id of a page; deleting that file (here: every second one, as
    a clean-up that keeps some does) made the next page start from the newest again: files listed twice."""
    ids = [alice.files.create(file=(f"{i}.jsonl", jsonl([chat_line(i)])), purpose="batch").id for i in range(7)]
    seen = []
    for i, listed in enumerate(alice.files.list(limit=2)):  # the client's auto-paging: 4 pages
        seen.append(listed.id)
        if i % 2 == 1:
            alice.files.delete(listed.id)  # the page's last file
    assert seen == ids[::-1]  # each once, newest first
    assert [f.id for f in alice.files.list()] == ids[::-1][0::2]
    unknown = httpx.get(f"{served.url}/v1/files", params={"after": "file-nope"},
                        headers={"Authorization": f"Bearer {alice.api_key}"})
    assert unknown.status_code == 400 and unknown.json()["error"]["field"] == "after"  # it listed from the start


def test_an_upload_with_an_idempotency_key_makes_one_file(alice: openai.OpenAI) -> None:
    """The openai client's retries (and any client's) of an upload whose answer was lost made a second file."""
    once = {"Idempotency-Key": "upload-1"}
    first = alice.files.create(file=("a.jsonl", jsonl([chat_line(0)])), purpose="batch", extra_headers=once)
    again = alice.files.create(file=("a.jsonl", jsonl([chat_line(0)])), purpose="batch", extra_headers=once)
    assert again.id == first.id and [f.id for f in alice.files.list()] == [first.id]
    with pytest.raises(openai.UnprocessableEntityError) as other:  # another file under the same key
        alice.files.create(file=("b.jsonl", jsonl([chat_line(1)])), purpose="batch", extra_headers=once)
    assert other.value.body["field"] == "Idempotency-Key" and first.id in other.value.body["message"]  # type: ignore[index]
    alice.files.delete(first.id)
    with pytest.raises(openai.UnprocessableEntityError, match="deleted since"):
        alice.files.create(file=("a.jsonl", jsonl([chat_line(0)])), purpose="batch", extra_headers=once)


def test_bad_uploads_and_batch_bodies_get_clear_4xx(
    alice: openai.OpenAI, served: ThreadedGateway, hook_settings: ServiceSettings
) -> None:
    with pytest.raises(openai.BadRequestError, match="purpose"):
        alice.files.create(file=("a.jsonl", jsonl([chat_line(0)])), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="line 2 is not valid JSON"):
        alice.files.create(file=("a.jsonl", b'{"a": 1}\n{oops\n'), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="no lines"):
        alice.files.create(file=("a.jsonl", b"\n\n"), purpose="batch")
    hook_settings.file_max_bytes = 100
    with pytest.raises(openai.APIStatusError) as too_large:
        alice.files.create(file=("a.jsonl", jsonl([chat_line(i) for i in range(3)])), purpose="batch")
    assert too_large.value.status_code == 413
    hook_settings.file_max_bytes = 10_000
    with pytest.raises(openai.NotFoundError):
        alice.files.retrieve("file-nothere")
    wrong_url = alice.files.create(
        file=("a.jsonl", jsonl([chat_line(0), {**chat_line(1), "url": "/v1/completions", "body": {"prompt": "x"}}])), purpose="batch"
    )
    with pytest.raises(openai.UnprocessableEntityError) as bad_lines:
        alice.batches.create(input_file_id=wrong_url.id, endpoint=CHAT, completion_window="24h")
    assert bad_lines.value.body["data"] == [  # type: ignore[index]
        {"line": 2, "code": "invalid_url", "message": f"url must be {CHAT}, the batch's endpoint"}
    ]
    good = alice.files.create(file=("a.jsonl", jsonl([chat_line(0)])), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        alice.batches.create(input_file_id=good.id, endpoint=CHAT, completion_window="soon")  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError) as too_long:  # 99999h was taken: expires_at in 2038, its jobs' at 7 d
        alice.batches.create(input_file_id=good.id, endpoint=CHAT, completion_window="99999h")  # type: ignore[arg-type]
    assert too_long.value.body["field"] == "completion_window" and "max_ttl_s" in too_long.value.body["message"]  # type: ignore[index]
    response = httpx.post(
        f"{served.url}/v1/batches",
        json={"input_file_id": good.id, "endpoint": "/v1/embeddings", "completion_window": "24h"},
        headers={"Authorization": f"Bearer {alice.api_key}"},
    )
    assert response.status_code == 400 and response.json()["error"]["field"] == "endpoint"
