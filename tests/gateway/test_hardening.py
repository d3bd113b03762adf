"""Request hardening over real HTTP: body size, prompt and max_tokens limits, strict schemas, text that cannot be
encoded, no stack traces, CORS off by default."""

from collections.abc import Iterator

import httpx
import pytest

from shared.settings import ServiceSettings
from tests.helpers.gateway import ThreadedGateway


@pytest.fixture
def http(settings: ServiceSettings) -> Iterator[httpx.Client]:
    settings.max_request_bytes = 4096
    settings.max_prompt_chars = 1000
    settings.max_tokens_limit = 64
    with ThreadedGateway(settings).start() as server, httpx.Client(base_url=server.url) as client:
        yield client


def test_large_bodies_are_413_before_they_are_read(http: httpx.Client) -> None:
    big = {"prompt": "x" * 5000}
    jobs = http.post("/v1/jobs", json=big)
    assert jobs.status_code == 413 and jobs.json()["error"]["code"] == "request_too_large"
    completions = http.post("/v1/completions", json=big)
    assert completions.status_code == 413 and completions.json()["error"]["type"] == "invalid_request_error"

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    streamed = http.post("/v1/jobs", content=chunked(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413


def test_prompt_and_max_tokens_limits(http: httpx.Client) -> None:
    too_many = http.post("/v1/jobs", json={"prompt": "x", "max_tokens": 65})
    assert too_many.status_code == 422 and too_many.json()["error"]["field"] == "max_tokens"
    openai_too_many = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 65})
    assert openai_too_many.status_code == 400 and openai_too_many.json()["error"]["param"] == "max_tokens"
    long_prompt = http.post(
        "/v1/jobs", json={"messages": [{"role": "user", "content": "y" * 1001}], "max_tokens": 8}
    )
    assert long_prompt.status_code == 413 and long_prompt.json()["error"]["field"] == "messages"
    assert http.post("/v1/jobs", json={"prompt": "y" * 1000, "max_tokens": 64}).status_code == 202


def test_strict_schemas(http: httpx.Client) -> None:
    assert (
        http.post("/v1/jobs", json={"prompt": "x", "model": "m"}).status_code == 422
    )  # specfleet's own route
    unknown = http.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "foo": 1}
    )
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "foo"
    tool_role = http.post("/v1/chat/completions", json={"messages": [{"role": "tool", "content": "x"}]})
    assert tool_role.status_code == 400


def test_control_characters_and_invalid_text(http: httpx.Client) -> None:
    assert (
        http.post("/v1/jobs", json={"prompt": "a\x00b\x1b[31m\u202e", "max_tokens": 8}).status_code == 202
    )  # plain text
    surrogate = b'{"prompt": "\\ud800", "max_tokens": 8}'
    headers = {"content-type": "application/json"}
    jobs = http.post("/v1/jobs", content=surrogate, headers=headers)
    assert jobs.status_code == 422 and "Unicode" in jobs.json()["error"]["message"]
    assert http.post("/v1/completions", content=surrogate, headers=headers).status_code == 400
    invalid_utf8 = http.post("/v1/jobs", content=b'{"prompt": "\xff\xfe"}', headers=headers)
    assert invalid_utf8.status_code == 400 and invalid_utf8.json()["error"]["code"] == "invalid_request"
    assert "Traceback" not in invalid_utf8.text
    openai_invalid = http.post("/v1/completions", content=b'{"prompt": "\xc3"}', headers=headers)
    assert openai_invalid.status_code == 400 and set(openai_invalid.json()) == {"error"}


def test_cors_is_off_by_default(http: httpx.Client) -> None:
    preflight = http.options(
        "/v1/jobs", headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    )
    assert "access-control-allow-origin" not in preflight.headers


def test_cors_for_configured_origins(settings: ServiceSettings) -> None:
    settings.cors_allow_origins = ["https://app.example"]
    with ThreadedGateway(settings).start() as server, httpx.Client(base_url=server.url) as client:
        ok = client.options(
            "/v1/jobs", headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
        )
        assert ok.headers["access-control-allow-origin"] == "https://app.example"
        other = client.get("/healthz", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers


@pytest.mark.parametrize(
    ("path", "extra"),
    [  # found by schemathesis (negative_data_rejection): lax coercion accepted wrongly typed values
        ("/v1/completions", {"logprobs": False}),
        ("/v1/chat/completions", {"parallel_tool_calls": 0}),
        ("/v1/completions", {"max_tokens": "5"}),
        ("/v1/chat/completions", {"stream": "yes"}),
        ("/v1/completions", {"temperature": True}),
    ],
)
def test_openai_fields_are_strictly_typed(http: httpx.Client, path: str, extra: dict[str, object]) -> None:
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    response = http.post(path, json={**body, **extra})
    assert response.status_code == 400 and response.json()["error"]["param"] == next(iter(extra))
