"""SSE over real HTTP: the stream's text equals the result; Last-Event-ID resumes with no gap or duplicate;
many followers racing a producer all see every event exactly once, in order."""

import asyncio
import random
import threading

import httpx
import pytest
import redis

from gateway.event_stream import JobEventStream
from gateway.streaming import FEED_TRIM_EVENTS, EventHub
from shared import keys
from shared.client import FleetClient, SseEvent, iter_sse
from shared.settings import ServiceSettings
from tests.helpers.gateway import ThreadedGateway
from tests.helpers.played_worker import PlayedWorker
from tests.helpers.waiting import wait_until

NUM_STEPS = 40


def _produce(
    worker: PlayedWorker,
    job_id: str,
    num_steps: int = NUM_STEPS,
    gate: threading.Event | None = None,
    gate_at: int = -1,
) -> None:
    for i in range(num_steps):
        if i == gate_at and gate is not None:
            gate.wait(10)
        last = i == num_steps - 1
        worker.emit(job_id, [i, i + 1000], f"<{i}>", finish_reason="length" if last else None)


def _text(events: list[SseEvent]) -> str:
    return "".join(e.data["text"] for e in events if e.event == "token")


def _token_ids(events: list[SseEvent]) -> list[int]:
    return [t for e in events if e.event == "token" for t in e.data["token_ids"]]


def test_stream_text_equals_result(
    gateway: ThreadedGateway, settings: ServiceSettings, rclient: redis.Redis
) -> None:
    with FleetClient(gateway.url) as client:
        job_id = client.submit({"prompt": "x", "max_tokens": 2 * NUM_STEPS})["id"]
        worker = PlayedWorker(rclient, settings)
        assert worker.take() == job_id
        producer = threading.Thread(target=_produce, args=(worker, job_id))
        producer.start()
        events = list(client.stream(job_id))
        producer.join()
        job = client.get(job_id)
    assert [e.event for e in events][-1] == "done"
    assert events[0].event == "status" and events[0].data["status"] == "running"
    assert _text(events) == job["output"]["text"] == "".join(f"<{i}>" for i in range(NUM_STEPS))
    assert _token_ids(events) == job["output"]["token_ids"]
    assert events[-1].data["usage"] == {"prompt_tokens": 3, "completion_tokens": 2 * NUM_STEPS, "cached_tokens": None}
    ids = [e.id for e in events]
    assert ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-")))) and len(set(ids)) == len(ids)


def test_a_submit_that_accepts_an_event_stream_answers_with_the_jobs_events(
    gateway: ThreadedGateway, settings: ServiceSettings, rclient: redis.Redis
) -> None:
    """One request: POST /v1/jobs with `Accept: text/event-stream` answers 200 with the job's events from its
    first, the job named in `x-specfleet-job-id` and `Location`; the same Idempotency-Key again streams the same
    job's events, all of them, once it has ended."""
    body = {"prompt": "x", "max_tokens": 2 * NUM_STEPS}
    headers = {"Accept": "text/event-stream", "Idempotency-Key": "one-request"}
    with FleetClient(gateway.url) as client:
        worker = PlayedWorker(rclient, settings)
        with client.http.stream("POST", "/v1/jobs", json=body, headers=headers) as response:
            job_id = response.headers["x-specfleet-job-id"]
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers["location"].endswith(f"/v1/jobs/{job_id}")
            assert worker.take() == job_id
            producer = threading.Thread(target=_produce, args=(worker, job_id))
            producer.start()
            events = list(iter_sse(response.iter_lines()))
            producer.join()
        with client.http.stream("POST", "/v1/jobs", json=body, headers=headers) as again:
            replayed = list(iter_sse(again.iter_lines()))
            replayed_id = again.headers["x-specfleet-job-id"]
        job = client.get(job_id)
    assert [e.event for e in events][0] == "status" and events[-1].event == "done"
    assert _text(events) == job["output"]["text"] == "".join(f"<{i}>" for i in range(NUM_STEPS))
    assert _token_ids(events) == job["output"]["token_ids"]
    assert replayed_id == job_id and replayed == events


def test_resume_with_last_event_id_mid_generation(
    gateway: ThreadedGateway, settings: ServiceSettings, rclient: redis.Redis
) -> None:
    with FleetClient(gateway.url) as client:
        job_id = client.submit({"prompt": "x"})["id"]
        worker = PlayedWorker(rclient, settings)
        worker.take()
        gate = threading.Event()
        producer = threading.Thread(
            target=_produce, args=(worker, job_id), kwargs={"gate": gate, "gate_at": 10}
        )
        producer.start()
        first = []
        for event in client.stream(job_id):  # read into the live part, then drop the connection
            first.append(event)
            if len(first) == 6:
                break
        gate.set()  # the producer goes on while this client is away
        rest = list(client.stream(job_id, last_event_id=first[-1].id))
        producer.join()
        everything = list(client.stream(job_id))
        assert first + rest == everything
        assert _text(first + rest) == client.get(job_id)["output"]["text"]
        assert list(client.stream(job_id, last_event_id=everything[-1].id)) == []  # resumed after the end


def test_a_stream_resumed_past_a_running_jobs_events_ends_with_the_job(
    settings: ServiceSettings, rclient: redis.Redis
) -> None:
    """A Last-Event-ID past every event the job will have (another job's id: they are times) yields nothing, and
    ends when the job does; it ended only at the next keepalive tick after that (sse_keepalive_s, 15 s by
    default: here 600, longer than this test waits)."""
    with ThreadedGateway(settings.model_copy(update={"sse_keepalive_s": 600.0})).start() as server:
        with FleetClient(server.url) as client:
            job_id = client.submit({"prompt": "x"})["id"]
            worker = PlayedWorker(rclient, settings)
            worker.take()
            worker.emit(job_id, [1], "<0>")  # running
            streamed: list[SseEvent] = []
            follower = threading.Thread(
                target=lambda: streamed.extend(client.stream(job_id, last_event_id="99999999999999-0")), daemon=True
            )
            follower.start()
            wait_until(lambda: _hub(server).num_followers == 1, what="the stream's follower", timeout_s=5)
            _produce(worker, job_id, num_steps=3)
            follower.join(timeout=60)
            assert not follower.is_alive() and streamed == []


def test_bad_last_event_id_is_422(
    gateway: ThreadedGateway, settings: ServiceSettings, rclient: redis.Redis
) -> None:
    with FleetClient(gateway.url) as client:
        job_id = client.submit({"prompt": "x"})["id"]
        response = client.http.get(f"/v1/jobs/{job_id}/stream", headers={"Last-Event-ID": "garbage"})
    assert response.status_code == 422 and response.json()["error"]["field"] == "header.last-event-id"


def test_cancel_ends_the_stream_with_error(
    gateway: ThreadedGateway, settings: ServiceSettings, rclient: redis.Redis
) -> None:
    with FleetClient(gateway.url) as client:
        job_id = client.submit({"prompt": "x"})["id"]
        worker = PlayedWorker(rclient, settings)
        worker.take()
        worker.emit(job_id, [1], "a")
        assert client.cancel(job_id)["status"] == "cancelled"
        finished, gone = worker.emit(job_id, [2], "b")  # the worker learns it at its next emit
        events = list(client.stream(job_id))
    assert (finished, gone) == ([], [job_id])
    assert events[-1].event == "error" and events[-1].data["error"]["code"] == "cancelled"
    assert _text(events) == "a"


@pytest.mark.parametrize("trim_events", [FEED_TRIM_EVENTS, 4], ids=["default", "trimmed-every-4"])
def test_many_followers_racing_the_producer(
    gateway: ThreadedGateway, settings: ServiceSettings, rclient: redis.Redis, trim_events: int
) -> None:
    """trimmed-every-4: the job's feed drops what its followers passed, 4 events or more at a time, so the late
    joiners and the resumed streams read what it dropped from Redis (gateway/streaming.py `_Feed.trim`)."""
    _hub(gateway).trim_events = trim_events
    num_clients, num_steps = 60, 150
    with FleetClient(gateway.url) as client:
        job_id = client.submit({"prompt": "x"})["id"]
    worker = PlayedWorker(rclient, settings)
    worker.take()
    producer = threading.Thread(target=_produce, args=(worker, job_id, num_steps))

    async def follow(http: httpx.AsyncClient, delay_s: float, reconnect_after: int | None) -> list[SseEvent]:
        await asyncio.sleep(delay_s)  # spreads the connects over the production (not a wait for a condition)
        events: list[SseEvent] = []
        headers: dict[str, str] = {}
        while not events or events[-1].event not in ("done", "error"):
            async with http.stream("GET", f"/v1/jobs/{job_id}/stream", headers=headers) as response:
                lines = [line async for line in _lines_until(response, reconnect_after)]
            new = list(iter_sse(lines))
            events += new
            headers = {"Last-Event-ID": events[-1].id} if events else {}
            reconnect_after = None
        return events

    async def main() -> list[list[SseEvent]]:
        limits = httpx.Limits(max_connections=num_clients + 5)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30, limits=limits) as http:
            rng = random.Random(7)
            tasks = [follow(http, rng.uniform(0, 0.3), rng.choice([None, 5, 20])) for _ in range(num_clients)]
            producer.start()
            return await asyncio.gather(*tasks)

    xrange_before = rclient.info("commandstats").get("cmdstat_xrange", {}).get("calls", 0)
    results = asyncio.run(main())
    producer.join()
    expected = [f"<{i}>" for i in range(num_steps)]
    for events in results:
        assert [e.data["text"] for e in events if e.event == "token"] == expected
        assert events[-1].event == "done"
    num_reads = rclient.info("commandstats")["cmdstat_xrange"]["calls"] - xrange_before
    # followers of one job share reads: far fewer than one XRANGE per follower per event
    assert num_reads < num_clients * num_steps / 10


async def _lines_until(response: httpx.Response, max_events: int | None):  # noqa: ANN202
    """The response's lines; stop (drop the connection) after max_events complete events."""
    num_events = 0
    async for line in response.aiter_lines():
        yield line
        if line == "":
            num_events += 1
            if max_events is not None and num_events >= max_events:
                return


def test_a_client_that_leaves_a_quiet_stream_ends_its_follower(gateway: ThreadedGateway) -> None:
    """A client that closes its stream while its job is quiet (still queued: nothing to write, and uvicorn drops a
    write to a closed connection without an error) leaves no follower behind: the gateway hears the disconnect
    itself (gateway/event_stream.py). The same through a streaming submit, and a streaming OpenAI call, whose
    abandoned job is cancelled."""
    hub = gateway.server.config.app.app.state.gateway.hub  # inside the tests' default-key shim
    with FleetClient(gateway.url) as client:
        job_id = client.submit({"prompt": "x", "max_tokens": 4})["id"]  # no worker: it stays queued
        requests = [
            ("GET", f"/v1/jobs/{job_id}/stream", {}, None),
            ("POST", "/v1/jobs", {"Accept": "text/event-stream"}, {"prompt": "y", "max_tokens": 4}),
            ("POST", "/v1/completions", {}, {"model": "m", "prompt": "z", "max_tokens": 4, "stream": True}),
        ]
        for method, path, headers, body in requests:
            with client.http.stream(method, path, headers=headers, json=body) as response:
                assert response.status_code == 200
                assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
                assert response.headers["cache-control"] == "no-cache"
                streamed_job = response.headers.get("x-specfleet-job-id", job_id)
                wait_until(lambda: hub.num_followers == 1, what="the stream's follower", timeout_s=5)
            wait_until(lambda: hub.num_followers == 0, what="the follower to end with its client", timeout_s=3)
        assert client.get(streamed_job)["status"] == "cancelled"  # the OpenAI call's: cancel_on_disconnect
        assert client.get(job_id)["status"] == "queued"  # a job's own stream leaves the job alone


def _hub(gateway: ThreadedGateway) -> EventHub:
    return gateway.server.config.app.app.state.gateway.hub  # type: ignore[no-any-return]  # inside the key shim


def test_a_job_s_last_step_and_the_stream_s_end_go_out_in_one_write(
    gateway: ThreadedGateway, settings: ServiceSettings, rclient: redis.Redis
) -> None:
    """A job stream's frame is one socket write: the events at hand together (its last token and `done`, written
    in one step) are one frame, and the response's end rides in it (gateway/event_stream.py): the ASGI messages
    of a stream resumed before the last token."""
    hub = _hub(gateway)
    with FleetClient(gateway.url) as client:
        job_id = client.submit({"prompt": "x", "max_tokens": 10})["id"]
        worker = PlayedWorker(rclient, settings)
        assert worker.take() == job_id
        _produce(worker, job_id, 3)
        events = list(client.stream(job_id))
    assert [e.event for e in events[-2:]] == ["token", "done"]
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:  # the client stays
        await asyncio.Event().wait()
        return {}

    stream = JobEventStream(hub, job_id, events[-3].id)
    assert hub._task is not None
    asyncio.run_coroutine_threadsafe(stream({"type": "http"}, receive, send), hub._task.get_loop()).result(10)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    body = sent[1]["body"]
    assert sent[1]["more_body"] is False and body.count(b"\n\n") == 2
    assert f"id: {events[-2].id}\nevent: token\n".encode() in body and b"event: done\n" in body


def test_a_long_jobs_feed_holds_a_window_and_a_late_stream_still_gets_every_event(
    gateway: ThreadedGateway, settings: ServiceSettings, rclient: redis.Redis
) -> None:
    """A followed feed keeps only what its followers have not passed (plus a trim's worth), not the job's whole
    output; a stream opened from the start after the job ended, while the feed lingers trimmed, gets every event
    once, in order: the dropped ones from Redis, then the feed's."""
    hub = _hub(gateway)
    hub.trim_events = 8
    num_steps = 400
    with FleetClient(gateway.url) as client:
        job_id = client.submit({"prompt": "x", "max_tokens": 2 * num_steps})["id"]
        worker = PlayedWorker(rclient, settings)
        assert worker.take() == job_id
        producer = threading.Thread(target=_produce, args=(worker, job_id, num_steps))
        producer.start()
        first = list(client.stream(job_id))
        producer.join()
        feed = hub._feeds[keys.job_channel(job_id)]
        late = list(client.stream(job_id))  # from "0-0": the feed lingers, its start dropped
        resumed = list(client.stream(job_id, last_event_id=first[100].id))
    expected = [f"<{i}>" for i in range(num_steps)]
    assert [e.data["text"] for e in first if e.event == "token"] == expected
    assert [e.id for e in late] == [e.id for e in first]
    assert [e.id for e in resumed] == [e.id for e in first[101:]]
    assert feed.trimmed_key > (0, 0) and len(feed.events) < 4 * hub.trim_events  # not the job's ~400 events


def test_a_stream_on_a_job_no_feed_held_starts_at_its_position_and_reads_a_batch_at_a_time(
    gateway: ThreadedGateway, settings: ServiceSettings, rclient: redis.Redis
) -> None:
    """A stream opened on a job whose events no feed here holds (a resume after the feed's linger, a job another
    gateway process streamed): its feed starts after the stream's position, not at the job's first event, and
    reads a batch at a time, trimming as it goes, so it never holds the job's whole output."""
    hub = _hub(gateway)
    num_steps = 400
    worker = PlayedWorker(rclient, settings)
    with FleetClient(gateway.url) as client:
        job_ids = [client.submit({"prompt": "x", "max_tokens": 2 * num_steps})["id"] for _ in range(2)]
        for job_id in job_ids:
            assert worker.take() == job_id
            _produce(worker, job_id, num_steps)  # nobody follows it: no feed
            assert keys.job_channel(job_id) not in hub._feeds
        ids = [[entry_id for entry_id, _ in rclient.xrange(keys.job_events(job_id))] for job_id in job_ids]
        expected = [f"<{i}>" for i in range(num_steps)]

        resumed = list(client.stream(job_ids[0], last_event_id=ids[0][300]))  # the default batch and trim
        feed = hub._feeds[keys.job_channel(job_ids[0])]
        assert [e.id for e in resumed] == ids[0][301:]
        assert feed.events[0].id == ids[0][301]  # its run started there: the first 300 events were never read

        hub.read_batch, hub.trim_events = 16, 8
        with client.http.stream("GET", f"/v1/jobs/{job_ids[1]}/stream") as response:  # from the start
            lines = list(response.iter_lines())
        late = list(iter_sse(lines))
        assert ": keepalive" not in lines  # each batch read on at once, none waited for the keepalive tick
        feed = hub._feeds[keys.job_channel(job_ids[1])]
        assert [e.data["text"] for e in late if e.event == "token"] == expected and late[-1].event == "done"
        assert [e.id for e in late] == ids[1]
        assert len(feed.events) < 2 * (hub.read_batch + hub.trim_events)  # not the job's ~400 events

        for past_every_entry in ("18446744073709551615-0", "18446744073709551615-18446744073709551615"):
            assert list(client.stream(job_ids[0], last_event_id=past_every_entry)) == []


def test_streams_racing_into_a_job_no_feed_held_each_get_every_event_after_their_position(
    gateway: ThreadedGateway, settings: ServiceSettings, rclient: redis.Redis
) -> None:
    """40 streams open at once on a job half produced with nobody following, each from its own position (the
    start, or a random Last-Event-ID), while the job produces the rest; its new feed reads 8 events at a time
    and trims every 4. Whichever stream makes the feed, each gets every event after its position once, in
    order (those before the feed's start from Redis)."""
    hub = _hub(gateway)
    hub.read_batch, hub.trim_events = 8, 4
    num_steps, num_clients = 300, 40
    worker = PlayedWorker(rclient, settings)
    with FleetClient(gateway.url) as client:
        job_id = client.submit({"prompt": "x", "max_tokens": 2 * num_steps})["id"]
    assert worker.take() == job_id
    gate = threading.Event()
    producer = threading.Thread(target=_produce, args=(worker, job_id, num_steps, gate, num_steps // 2))
    producer.start()
    wait_until(lambda: rclient.xlen(keys.job_events(job_id)) >= num_steps // 2, what="half the job's events")
    first_half = [entry_id for entry_id, _ in rclient.xrange(keys.job_events(job_id))]
    rng = random.Random(11)
    positions = [rng.choice([None, *first_half]) for _ in range(num_clients)]

    async def follow(http: httpx.AsyncClient, last_event_id: str | None) -> list[SseEvent]:
        headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
        async with http.stream("GET", f"/v1/jobs/{job_id}/stream", headers=headers) as response:
            return list(iter_sse([line async for line in response.aiter_lines()]))

    async def main() -> list[list[SseEvent]]:
        limits = httpx.Limits(max_connections=num_clients + 5)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30, limits=limits) as http:
            tasks = [asyncio.create_task(follow(http, position)) for position in positions]
            await asyncio.sleep(0.2)  # the streams open while the job is quiet, then it produces the rest
            gate.set()
            return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    producer.join()
    ids = [entry_id for entry_id, _ in rclient.xrange(keys.job_events(job_id))]
    assert len(ids) == num_steps + 2  # `running`, the tokens, `done`
    for position, events in zip(positions, results, strict=True):
        start = 0 if position is None else ids.index(position) + 1
        assert [e.id for e in events] == ids[start:]
        assert events[-1].event == "done"
