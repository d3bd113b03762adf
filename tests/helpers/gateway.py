"""The real gateway app served by uvicorn on a free port, in a thread of the test process."""

import threading
from collections.abc import Iterator

import pytest
import redis
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.main import create_app
from shared.redis_server import free_port
from shared.settings import ServiceSettings
from tests.helpers.redis_fixtures import create_key
from tests.helpers.waiting import wait_until


class _DefaultKey:
    """ASGI shim of the tests that are not about authentication: a request without an Authorization header
    gets the test's admin key (the gateway itself always requires one)."""

    def __init__(self, app: ASGIApp, secret: str) -> None:
        self.app = app
        self.header = (b"authorization", f"Bearer {secret}".encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not any(k == b"authorization" for k, _ in scope["headers"]):
            scope = {**scope, "headers": [*scope["headers"], self.header]}
        await self.app(scope, receive, send)


class ThreadedGateway:
    """The real gateway app served by uvicorn on a free port, in a background thread.

    default_key: requests without an Authorization header are sent with a fresh admin key (`self.api_key`),
    for the tests of everything but authentication. False: the gateway exactly as deployed."""

    def __init__(self, settings: ServiceSettings, default_key: bool = True) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app: ASGIApp = create_app(settings)
        self.api_key = ""
        if default_key:
            assert settings.redis_url is not None
            try:
                self.api_key = create_key(
                    settings.redis_url,
                    "tests-admin",
                    num_partitions=settings.redis_partitions,
                    is_admin=True,
                    webhook_secret=settings.webhook_secret.get_secret_value(),  # the service's: tests verify it
                )[1]
            except redis.ConnectionError:  # the tests of a gateway whose Redis is down
                self.api_key = "sf-no-redis"
            app = _DefaultKey(app, self.api_key)
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            ws="none",
            lifespan="on",
            timeout_graceful_shutdown=1,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="gateway", daemon=True)

    def start(self) -> "ThreadedGateway":
        self.thread.start()
        wait_until(lambda: self.server.started, what="the gateway to start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> "ThreadedGateway":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture
def gateway(settings: ServiceSettings) -> Iterator[ThreadedGateway]:
    server = ThreadedGateway(settings).start()
    yield server
    server.stop()
