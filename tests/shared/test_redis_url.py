"""REDIS_URL's three forms: parsing, the errors a bad URL gets, and Celery's broker for each topology."""

import pytest
from pydantic import ValidationError

from shared.redis_url import FORMS, RedisUrlError, Topology, celery_broker, parse
from shared.settings import ServiceSettings


@pytest.mark.parametrize(
    ("url", "topology", "nodes", "master", "db", "is_tls"),
    [
        ("redis://127.0.0.1:6379/2", Topology.STANDALONE, (), "", 0, False),
        ("rediss://cache.example:6380", Topology.STANDALONE, (), "", 0, True),
        ("unix:///tmp/redis.sock", Topology.STANDALONE, (), "", 0, False),
        ("redis+sentinel://s1:26379,s2:26379/mymaster/3", Topology.SENTINEL, (("s1", 26379), ("s2", 26379)),
         "mymaster", 3, False),
        ("rediss+sentinel://:pw@s1:26379/m", Topology.SENTINEL, (("s1", 26379),), "m", 0, True),
        ("redis+cluster://n1:7000,n2:7001,n3:7002", Topology.CLUSTER, (("n1", 7000), ("n2", 7001), ("n3", 7002)),
         "", 0, False),
    ],
)
def test_the_three_forms(
    url: str, topology: Topology, nodes: tuple[tuple[str, int], ...], master: str, db: int, is_tls: bool
) -> None:
    target = parse(url)
    assert (target.topology, target.nodes, target.master_name, target.db, target.is_tls) == (
        topology, nodes, master, db, is_tls
    )


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("localhost:6379", "no scheme"),
        ("http://localhost:6379", "unknown scheme 'http'"),
        ("redis+sentinel://s1:26379", "names the master"),
        ("redis+sentinel://s1/mymaster", "'s1' is not host:port"),
        ("redis+sentinel://s1:26379/m/x", "'x' is not a number"),
        ("redis+cluster://n1:7000/3", "only database 0"),
        ("redis+cluster://n1:7000,,n2:7001", "'(empty)' is not host:port"),
        ("redis+cluster://n1:99999", "is not host:port"),
    ],
)
def test_a_bad_url_names_the_forms_expected(url: str, reason: str) -> None:
    with pytest.raises(RedisUrlError) as caught:
        parse(url)
    assert reason in str(caught.value) and FORMS in str(caught.value)


def test_the_error_never_shows_the_password() -> None:
    with pytest.raises(RedisUrlError) as caught:
        parse("redis+sentinel://:hunter2@s1:26379")
    assert "hunter2" not in str(caught.value)


def test_settings_refuse_a_bad_redis_url_at_start() -> None:
    with pytest.raises(ValidationError) as caught:
        ServiceSettings(redis_url="redis+cluster://n1")
    assert "redis+cluster://host:port" in str(caught.value)


def test_celery_broker_per_topology() -> None:
    assert celery_broker("redis://h:6379/0", None) == ("redis://h:6379/0", {})
    url, options = celery_broker("redis+sentinel://:pw@s1:26379,s2:26379/mymaster/2", None)
    assert url == "sentinel://:pw@s1:26379/2;sentinel://:pw@s2:26379/2" and options == {"master_name": "mymaster"}
    assert celery_broker("redis+cluster://n1:7000", "redis://broker:6379/0") == ("redis://broker:6379/0", {})
    with pytest.raises(RedisUrlError, match="SPECFLEET_CELERY_BROKER_URL"):
        celery_broker("redis+cluster://n1:7000", None)  # kombu has no Cluster transport: refused, not ignored
    with pytest.raises(RedisUrlError, match="cannot use a Redis Cluster"):
        celery_broker("redis://h:6379/0", "redis+cluster://n1:7000")
