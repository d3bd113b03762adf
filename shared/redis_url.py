"""One setting, three topologies: the one place a Redis client is made from `REDIS_URL`.

    redis://[user:pass@]host:port[/db]   rediss://...   unix:///path/redis.sock[?db=N]        standalone
    redis+sentinel://[user:pass@]host:port[,host:port...]/MASTER_NAME[/db]                      Sentinel
    redis+cluster://[user:pass@]host:port[,host:port...]                                        Cluster

`redis+sentinel` and `redis+cluster` take `rediss` variants (`rediss+sentinel://`, `rediss+cluster://`) for TLS.
The credentials are the data nodes' (the master's, every cluster node's); the sentinels are asked without them.

Standalone: redis-py's own retries. Sentinel: the client asks the sentinels for the master at each new
connection, and a command that meets a dead or demoted master is retried with exponential backoff (up to
`RETRY_COUNT` times, `RETRY_CAP_S` apart at most: longer than a failover), so it lands on the promoted replica. Cluster: a
`RedisCluster` that follows MOVED/ASK and refreshes its slot map; multi-key commands and scripts must keep to
one slot (shared/keys.py hash-tags the keys: see the README's "Redis topologies").
"""

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, cast
from urllib.parse import unquote

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.sentinel
import redis.client
import redis.cluster
import redis.sentinel
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError as RedisResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from shared import keys

FORMS = (
    "redis://host:port[/db], rediss://host:port[/db], unix:///path/to.sock, "
    "redis+sentinel://host:port[,host:port...]/MASTER_NAME[/db], redis+cluster://host:port[,host:port...]"
)
RETRY_BASE_S = 0.1  # first backoff of a retried command (doubling, with jitter)
RETRY_CAP_S = 2.0  # longest wait between two retries
RETRY_COUNT = 8  # retries of one command: about 10 s of backoff, longer than a Sentinel failover's election


class Topology(StrEnum):
    STANDALONE = "standalone"
    SENTINEL = "sentinel"
    CLUSTER = "cluster"


class RedisUrlError(ValueError):
    """A REDIS_URL that is none of the forms in FORMS."""

    def __init__(self, url: str, reason: str) -> None:
        shown = url.split("@")[-1] if "@" in url else url  # never echo a password
        super().__init__(f"bad REDIS_URL {shown!r}: {reason}; expected one of: {FORMS}")


@dataclass(frozen=True)
class RedisTarget:
    """A parsed REDIS_URL."""

    topology: Topology
    url: str  # as given (standalone: what redis-py's from_url reads)
    nodes: tuple[tuple[str, int], ...] = ()  # sentinels, or cluster seed nodes
    master_name: str = ""  # sentinel only
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    is_tls: bool = False


def _split_credentials(url: str, netloc: str) -> tuple[str | None, str | None, str]:
    if "@" not in netloc:
        return None, None, netloc
    creds, hosts = netloc.rsplit("@", 1)
    user, _, password = creds.partition(":")
    if not password and user:  # `redis://secret@host` means a password, as redis-py reads it
        return None, unquote(user), hosts
    return (unquote(user) or None), (unquote(password) or None), hosts


def _nodes(url: str, hosts: str) -> tuple[tuple[str, int], ...]:
    nodes = []
    for part in hosts.split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RedisUrlError(url, f"{part.strip() or '(empty)'!r} is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    return tuple(nodes)


def _db(url: str, text: str) -> int:
    if not text.isdigit():
        raise RedisUrlError(url, f"the database {text!r} is not a number")
    return int(text)


def parse(url: str) -> RedisTarget:
    """REDIS_URL -> its topology and parts; raises RedisUrlError naming the forms expected."""
    url = url.strip()
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise RedisUrlError(url, "no scheme")
    scheme = scheme.lower()
    if scheme in ("redis", "rediss", "unix"):
        if not rest.strip("/"):
            raise RedisUrlError(url, "no host")
        return RedisTarget(Topology.STANDALONE, url, is_tls=scheme == "rediss")
    base, plus, kind = scheme.partition("+")
    if not plus or base not in ("redis", "rediss") or kind not in ("sentinel", "cluster"):
        raise RedisUrlError(url, f"unknown scheme {scheme!r}")
    rest = rest.split("?", 1)[0]
    netloc, _, path = rest.partition("/")
    user, password, hosts = _split_credentials(url, netloc)
    nodes = _nodes(url, hosts)
    parts = [p for p in path.split("/") if p]
    if kind == "cluster":
        if parts and parts != ["0"]:
            raise RedisUrlError(url, "a cluster has only database 0 (no path after the nodes)")
        return RedisTarget(Topology.CLUSTER, url, nodes, username=user, password=password, is_tls=base == "rediss")
    if not parts or len(parts) > 2:
        raise RedisUrlError(url, "a sentinel URL names the master after the nodes: .../MASTER_NAME[/db]")
    db = _db(url, parts[1]) if len(parts) == 2 else 0
    return RedisTarget(
        Topology.SENTINEL, url, nodes, parts[0], db, username=user, password=password, is_tls=base == "rediss"
    )


def _retry_kwargs() -> dict[str, Any]:
    return {
        "retry": Retry(ExponentialWithJitterBackoff(base=RETRY_BASE_S, cap=RETRY_CAP_S), RETRY_COUNT),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
    }


def _async_retry_kwargs() -> dict[str, Any]:
    from redis.asyncio.retry import Retry as AsyncRetry

    return {
        "retry": AsyncRetry(ExponentialWithJitterBackoff(base=RETRY_BASE_S, cap=RETRY_CAP_S), RETRY_COUNT),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
    }


def _data_kwargs(target: RedisTarget) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"username": target.username, "password": target.password}
    if target.is_tls:
        kwargs["ssl"] = True
    return kwargs


def _sentinel_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The sentinels are asked with the client's timeouts only (no data-node credentials, no decoding)."""
    keep = ("socket_timeout", "socket_connect_timeout")
    return {k: v for k, v in kwargs.items() if k in keep}


def _cluster_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """RedisCluster takes no db and no connection-level retry (it retries and re-routes itself)."""
    return {k: v for k, v in kwargs.items() if k not in ("db", "retry", "retry_on_error", "health_check_interval")}


class _SentinelMaster(redis.Redis):
    """The master's client; closing it also closes its connections to the sentinels."""

    sentinel_manager: redis.sentinel.Sentinel | None = None

    def close(self) -> None:
        super().close()
        for node in self.sentinel_manager.sentinels if self.sentinel_manager else []:
            node.close()


class _AsyncSentinelMaster(redis.asyncio.Redis):
    sentinel_manager: redis.asyncio.sentinel.Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        for node in self.sentinel_manager.sentinels if self.sentinel_manager else []:
            await node.aclose()


def client(url: str, **kwargs: Any) -> redis.Redis:
    """A synchronous client for REDIS_URL (kwargs: redis-py's, e.g. decode_responses, socket_timeout).

    Typed as redis.Redis for every topology: a RedisCluster answers the same commands, scripts and pub/sub
    (redis-py has no common base class for the two), so callers do not branch on the topology."""
    target = parse(url)
    if target.topology is Topology.STANDALONE:
        return redis.Redis.from_url(url, **kwargs)  # redis-py's own retries (3, backoff)
    if target.topology is Topology.SENTINEL:
        sentinel = redis.sentinel.Sentinel(
            list(target.nodes), sentinel_kwargs=_sentinel_kwargs(kwargs), **_sentinel_kwargs(kwargs)
        )
        master = sentinel.master_for(
            target.master_name,
            redis_class=_SentinelMaster,
            db=target.db,
            **{**_retry_kwargs(), **_data_kwargs(target), **kwargs},
        )
        master.sentinel_manager = sentinel
        return master
    nodes = [redis.cluster.ClusterNode(host, port) for host, port in target.nodes]
    cluster = redis.cluster.RedisCluster(startup_nodes=nodes, **_cluster_kwargs({**_data_kwargs(target), **kwargs}))
    return cast(redis.Redis, cluster)


def async_client(
    url: str, *, max_connections: int | None = None, **kwargs: Any
) -> redis.asyncio.Redis:
    """An asyncio client for REDIS_URL. max_connections: standalone, a blocking pool of that size (a request
    waits for a free connection); Sentinel: the pool's cap; Cluster: the cap per node."""
    target = parse(url)
    if target.topology is Topology.STANDALONE:
        if max_connections is None:
            return redis.asyncio.Redis.from_url(url, **kwargs)
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=10, **kwargs
        )
        return redis.asyncio.Redis.from_pool(pool)  # owns the pool: aclose() closes it
    if target.topology is Topology.SENTINEL:
        sentinel = redis.asyncio.sentinel.Sentinel(
            list(target.nodes), sentinel_kwargs=_sentinel_kwargs(kwargs), **_sentinel_kwargs(kwargs)
        )
        extra = {} if max_connections is None else {"max_connections": max_connections}
        master = sentinel.master_for(
            target.master_name,
            redis_class=_AsyncSentinelMaster,
            db=target.db,
            **{**_async_retry_kwargs(), **_data_kwargs(target), **extra, **kwargs},
        )
        master.sentinel_manager = sentinel
        return master
    nodes = [redis.asyncio.cluster.ClusterNode(host, port) for host, port in target.nodes]
    extra = {} if max_connections is None else {"max_connections": max_connections}
    cluster = redis.asyncio.cluster.RedisCluster(
        startup_nodes=nodes, **_cluster_kwargs({**_data_kwargs(target), **extra, **kwargs})
    )
    return cast(redis.asyncio.Redis, cluster)  # the same commands (see client())


def celery_broker(redis_url: str, broker_url: str | None) -> tuple[str, dict[str, Any]]:
    """Celery's broker -> (kombu url, transport options to add). `broker_url` (settings.celery_broker_url) when
    set, else REDIS_URL itself. A Sentinel URL becomes kombu's form (`sentinel://h:p/db;sentinel://h:p/db` with
    the master name as a transport option). Kombu has no Redis Cluster transport: a Cluster REDIS_URL needs its
    own standalone or Sentinel broker, and without one this raises rather than fail later."""
    url = broker_url or redis_url
    target = parse(url)
    if target.topology is Topology.CLUSTER:
        raise RedisUrlError(
            url,
            "Celery's Redis broker cannot use a Redis Cluster; set SPECFLEET_CELERY_BROKER_URL to a standalone or "
            "Sentinel Redis (the README's \"Redis topologies\")",
        )
    if target.topology is Topology.STANDALONE:
        return url, {}
    auth = f":{target.password}@" if target.password else ""
    scheme = "sentinel"
    kombu_url = ";".join(f"{scheme}://{auth}{host}:{port}/{target.db}" for host, port in target.nodes)
    return kombu_url, {"master_name": target.master_name}


def pipeline(client: redis.Redis, *, transaction: bool = False, partition: int = 0) -> "redis.client.Pipeline":
    """A pipeline that may carry scripts (EVALSHA) and MULTI on every topology, for one partition's keys
    (shared/keys.py: one hash tag each) and the global keys when `partition` is 0.

    RedisCluster's own pipelines refuse scripts. A partition's keys share one hash tag, so on a Cluster this is a
    plain pipeline on the node that owns that slot now; if the slot has moved meanwhile the pipeline fails (MOVED,
    a RedisError every caller already handles) and the next one goes to the new owner."""
    if isinstance(client, redis.cluster.RedisCluster):
        return _node_of(client, partition).redis_connection.pipeline(transaction=transaction)  # type: ignore[union-attr]
    return client.pipeline(transaction=transaction)


def _node_of(client: "redis.cluster.RedisCluster", partition: int) -> Any:
    tag = keys.prefix(partition)
    node = client.get_node_from_key(tag)
    if node is None or node.redis_connection is None:
        raise RedisConnectionError(f"no cluster node serves the slot of {tag!r}")
    return node


class PartitionPipelines:
    """Pipelines for commands of several partitions, executed together: off a Cluster ONE pipeline carries them
    all (one round trip); on a Cluster, one per node that owns some of the partitions' slots (`pipeline`).
    Queue a partition's commands on `of(partition)`, remember `len(...)` before and after, read them back from
    `execute()[pipe]`."""

    def __init__(self, client: redis.Redis, held: "HeldConnection | None" = None) -> None:
        self.redis = client
        self._held = held  # off a Cluster: the one pipeline's commands go out on it (HeldConnection)
        self._pipes: dict[str, redis.client.Pipeline] = {}

    def of(self, partition: int) -> "redis.client.Pipeline":
        """The pipeline that carries `partition`'s commands (non-transactional)."""
        name = ""
        if isinstance(self.redis, redis.cluster.RedisCluster):
            name = str(_node_of(self.redis, partition).name)
        if name not in self._pipes:
            self._pipes[name] = pipeline(self.redis, partition=partition)
        return self._pipes[name]

    def execute(self, *, raise_on_error: bool = True) -> dict[int, list[Any]]:
        """Execute every pipeline -> id(pipeline) -> its replies."""
        if self._held is not None and len(self._pipes) == 1:
            (pipe,) = self._pipes.values()
            replies = self._held.execute([args for args, _ in pipe.command_stack])
            errors = [reply for reply in replies if isinstance(reply, Exception)]
            if raise_on_error and errors:
                raise errors[0]
            return {id(pipe): replies}
        return {id(pipe): pipe.execute(raise_on_error=raise_on_error) for pipe in self._pipes.values()}


class HeldConnection:
    """One connection of a client's pool, held by one owner that sends a batch of commands at a time from one
    thread (the worker's writer process, once a step): the batch goes out as one packed write and its replies are
    read back in order, as a pipeline's are, without what Pipeline.execute adds around that (the pool checkout
    and release, its retry and instrumentation wrappers, reply callbacks): a one-script batch, warm, ~90 against
    ~160 us of CPU (the STEP call of one token, 2026-12-04). Replies come as the server sent them (decoded as the
    client decodes); a command that failed gives its ResponseError in its place. A dropped connection or a
    timeout retries the whole batch as the connection's retry policy says, as redis-py's pipeline does (none on a
    standalone client: the batch fails, and the next one connects again). Standalone and Sentinel clients only."""

    def __init__(self, client: redis.Redis) -> None:
        if isinstance(client, redis.cluster.RedisCluster):
            raise TypeError("a Cluster client sends by node: use PartitionPipelines without a HeldConnection")
        self._pool = client.connection_pool
        self._conn: Any = None  # taken at the first batch (the server need not be up before)

    def execute(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send `commands` (each a command's arguments) in one write -> their replies, in order."""
        if self._conn is None:
            self._conn = self._pool.get_connection()  # connects; a RedisError when it cannot
        conn = self._conn
        replies = conn.retry.call_with_retry(lambda: self._round_trip(commands), lambda _: conn.disconnect())
        return cast(list[Any], replies)

    def _round_trip(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        conn = self._conn
        conn.connect()  # nothing when connected; else through the connection's own connect (Sentinel: the master now)
        conn.send_packed_command(conn.pack_commands(commands))
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(conn.read_response())
            except RedisResponseError as exc:  # that command failed; the rest of the replies follow it
                replies.append(exc)
        return replies

    def close(self) -> None:
        if self._conn is not None:
            self._pool.release(self._conn)
            self._conn = None
