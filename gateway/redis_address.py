"""Where the gateway's own Redis connections go (its pub/sub connection, gateway/pubsub.py, and its command
connection, gateway/redis_wire.py), and how they identify themselves, from REDIS_URL at each connect:

    standalone: its host and port or its unix socket, its credentials, database and TLS options
    Sentinel:   the master the sentinels name now (asked at every connect, so a failover is followed)
    Cluster:    a seed node, the next one each connect (only pub/sub connects to a Cluster this way)
"""

import asyncio
import ssl
from dataclasses import dataclass
from typing import Any

from redis.asyncio.connection import parse_url
from redis.asyncio.sentinel import Sentinel

from shared.redis_url import RedisTarget, Topology

CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Address:
    """Where one connect goes, and how it identifies itself."""

    host: str = "localhost"
    port: int = 6379
    path: str | None = None  # a unix socket (then host and port are unused)
    username: str | None = None
    password: str | None = None
    tls: ssl.SSLContext | None = None
    db: int = 0  # SELECTed by a command connection (pub/sub ignores databases)

    async def open(self, protocol_factory: Any) -> Any:
        """Connect (within CONNECT_TIMEOUT_S) -> the protocol the factory made for the connection."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            if self.path is not None:
                _, protocol = await loop.create_unix_connection(protocol_factory, self.path, ssl=self.tls)
            else:
                _, protocol = await loop.create_connection(protocol_factory, self.host, self.port, ssl=self.tls)
        return protocol

    def hello(self) -> list[tuple[str, ...]]:
        """What a RESP2 connection (pub/sub) sends first: AUTH when there is a password."""
        if self.password is None:
            return []
        return [("AUTH", self.username, self.password) if self.username else ("AUTH", self.password)]

    def hello_resp3(self) -> tuple[str | int, ...]:
        """What a RESP3 connection sends first: HELLO 3, with the credentials (a password alone authenticates the
        `default` user)."""
        if self.password is None:
            return ("HELLO", 3)
        return ("HELLO", 3, "AUTH", self.username or "default", self.password)


def tls_context(options: dict[str, Any]) -> ssl.SSLContext:
    """An SSL context as redis-py's SSLConnection makes one from the URL's options: the peer's certificate and
    host name checked unless `ssl_cert_reqs=none` (or `optional`, or `ssl_check_hostname=false`)."""
    context = ssl.create_default_context(cafile=options.get("ssl_ca_certs"))
    cert_reqs = str(options.get("ssl_cert_reqs", "required")).lower()
    if cert_reqs == "none":
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        context.check_hostname = bool(options.get("ssl_check_hostname", True))
        if cert_reqs == "optional":
            context.verify_mode = ssl.CERT_OPTIONAL
    if options.get("ssl_certfile"):
        context.load_cert_chain(options["ssl_certfile"], options.get("ssl_keyfile"))
    return context


async def address_of(target: RedisTarget, attempt: int = 0) -> Address:
    """Where connect number `attempt` goes (a Cluster's seed nodes in turn); Sentinel: asks the sentinels."""
    if target.topology is Topology.STANDALONE:
        options: dict[str, Any] = dict(parse_url(target.url))
        is_tls = target.url.lower().startswith("rediss://")
        return Address(
            host=options.get("host", "localhost"),
            port=int(options.get("port", 6379)),
            path=options.get("path"),
            username=options.get("username"),
            password=options.get("password"),
            tls=tls_context(options) if is_tls else None,
            db=int(options.get("db", 0) or 0),
        )
    tls = tls_context({}) if target.is_tls else None
    if target.topology is Topology.SENTINEL:
        sentinel = Sentinel(list(target.nodes), socket_timeout=CONNECT_TIMEOUT_S)
        try:
            host, port = await sentinel.discover_master(target.master_name)
        finally:
            for node in sentinel.sentinels:
                await node.aclose()
    else:  # a cluster: the seed nodes in turn
        host, port = target.nodes[attempt % len(target.nodes)]
    return Address(host, int(port), None, target.username, target.password, tls, target.db)
