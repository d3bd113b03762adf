"""GET /v1/jobs/{id}/stream on its short path (gateway/stream_route.py) over real HTTP: a held stream keeps far
fewer objects alive in the gateway than a stream FastAPI's routing serves; its refusals stay the route's; its
responses are counted like every other."""

import gc
import json
import socket
from collections.abc import Iterator

import httpx
import pytest
import redis
from prometheus_client import REGISTRY

from shared.api_keys import KeyRegistry
from shared.settings import ServiceSettings
from tests.helpers.gateway import ThreadedGateway
from tests.helpers.redis_fixtures import create_key
from tests.helpers.waiting import wait_until

NUM_STREAMS = 40


@pytest.fixture
def bare(settings: ServiceSettings) -> Iterator[ThreadedGateway]:
    """The gateway exactly as deployed: no default key, no shim in front of its app."""
    with ThreadedGateway(settings, default_key=False).start() as server:
        yield server


def _open_stream(port: int, request: bytes) -> socket.socket:
    """A raw connection whose request was answered with 200 and an event stream (its head read, nothing more):
    the client side of a held stream costs the test process almost nothing."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(request)
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head, head[:300]
    return sock


def _tracked_objects_per_stream(server: ThreadedGateway, requests: list[bytes]) -> float:
    """What each of the requests' streams, held open at once, adds to the objects the gateway's collector tracks
    (the gateway runs in this process)."""
    hub = server.server.config.app.state.gateway.hub
    gc.collect()
    before = len(gc.get_objects())
    socks = [_open_stream(server.port, request) for request in requests]
    try:
        wait_until(lambda: hub.num_followers == len(requests), what="every stream's follower")
        gc.collect()
        return (len(gc.get_objects()) - before) / len(requests)
    finally:
        for sock in socks:
            sock.close()
        wait_until(lambda: hub.num_followers == 0, what="the followers to end with their clients")


def test_a_held_stream_keeps_far_fewer_objects_alive_than_one_fastapi_routes(
    bare: ThreadedGateway, redis_url: str
) -> None:
    """Each stream follows a job of its own that stays queued (no worker), so each keeps its job's feed, its
    follower and its connection; the short path drops the router's layers, the streaming submit keeps them."""
    secret = create_key(redis_url, "streams")[1]
    auth = f"Authorization: Bearer {secret}\r\n".encode()
    with httpx.Client(base_url=bare.url, headers={"Authorization": f"Bearer {secret}"}) as http:
        job_ids = [http.post("/v1/jobs", json={"prompt": "x"}).json()["id"] for _ in range(NUM_STREAMS)]
    short = [b"GET /v1/jobs/" + j.encode() + b"/stream HTTP/1.1\r\nHost: t\r\n" + auth + b"\r\n" for j in job_ids]
    body = json.dumps({"prompt": "x"}).encode()
    routed = [
        b"POST /v1/jobs HTTP/1.1\r\nHost: t\r\nAccept: text/event-stream\r\nContent-Type: application/json\r\n"
        + auth + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        for _ in range(NUM_STREAMS)
    ]  # fmt: skip
    per_short = _tracked_objects_per_stream(bare, short)
    per_routed = _tracked_objects_per_stream(bare, routed)
    # measured: ~105 against ~160 (~210 with Starlette's StreamingResponse before gateway/event_stream.py)
    assert per_short < 0.8 * per_routed, (per_short, per_routed)


def test_the_short_path_refuses_as_the_route_and_is_counted(
    bare: ThreadedGateway, redis_url: str, rclient: redis.Redis
) -> None:
    """A refused stream request gets the route's own answer (the short path hands it on); a served one is
    counted in specfleet_http_responses_total like any response."""
    alice_key, alice = create_key(redis_url, "alice")
    bob = create_key(redis_url, "bob")[1]
    with httpx.Client(base_url=bare.url) as http:
        job_id = http.post("/v1/jobs", json={"prompt": "x"}, headers={"Authorization": f"Bearer {alice}"}).json()["id"]
        path = f"/v1/jobs/{job_id}/stream"
        served_before = REGISTRY.get_sample_value("specfleet_http_responses_total", {"code": "200"}) or 0.0
        with http.stream("GET", path, headers={"Authorization": f"Bearer {alice}"}) as response:
            assert response.status_code == 200
        assert REGISTRY.get_sample_value("specfleet_http_responses_total", {"code": "200"}) == served_before + 1
        refusals = [
            ({}, 401, "missing API key"),
            ({"Authorization": "Bearer sf-not-a-key"}, 401, "invalid API key"),
            ({"Authorization": f"Basic {alice}"}, 401, "missing API key"),
            ({"Authorization": f"Bearer {bob}"}, 404, f"no job {job_id}"),
            ({"Authorization": f"Bearer {alice}", "Last-Event-ID": "1-x"}, 422, "last-event-id"),
        ]
        for headers, status, message in refusals:
            response = http.get(path, headers=headers)
            assert response.status_code == status, (headers, response.text)
            assert message in response.text.lower() or message in response.text, (headers, response.text)
        KeyRegistry(rclient).revoke(alice_key.id)
        revoked = http.get(path, headers={"Authorization": f"Bearer {alice}"})
        assert revoked.status_code == 401 and "revoked" in revoked.json()["error"]["message"]
