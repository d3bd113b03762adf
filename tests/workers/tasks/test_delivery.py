"""One delivery attempt and the retry schedule, without Celery (a real receiver on loopback)."""

import ipaddress
import random

from shared.ssrf import Allowlist, Target
from tests.helpers.tasks import Receiver
from workers.tasks.delivery import attempt, backoff_s, parse_retry_after, pinned

LOOPBACK = Allowlist.parse(["127.0.0.0/8"])


def test_backoff_grows_is_capped_jittered_and_honours_retry_after() -> None:
    rng = random.Random(0)
    delays = [backoff_s(n, 1.0, 10.0, rng=rng) for n in range(1, 8)]
    for n, delay in enumerate(delays, start=1):
        ceiling = min(10.0, 2 ** (n - 1))
        assert ceiling / 2 <= delay <= ceiling
    assert backoff_s(1, 1.0, 10.0, retry_after_s=7.0, rng=rng) == 7.0
    assert backoff_s(1, 1.0, 10.0, retry_after_s=3600.0, rng=rng) == 10.0  # capped


def test_retry_after_forms() -> None:
    assert parse_retry_after("5") == 5.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now_s=1445412470.0) == 10.0
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None


def test_pinned_connects_to_the_checked_address_with_the_real_host() -> None:
    target = Target(
        "https://hooks.example.com/a?b=1",
        "https",
        "hooks.example.com",
        443,
        ipaddress.ip_address("93.184.216.34"),
    )
    assert pinned(target) == (
        "https://93.184.216.34:443/a?b=1",
        {"Host": "hooks.example.com"},
        {"sni_hostname": "hooks.example.com"},
    )
    v6 = Target("http://h.example:8080/", "http", "h.example", 8080, ipaddress.ip_address("2606:2800::1"))
    assert pinned(v6)[:2] == ("http://[2606:2800::1]:8080/", {"Host": "h.example:8080"})


def test_attempt_outcomes(receiver: Receiver) -> None:
    receiver.script.update({"/r": [302], "/t": [429], "/g": [410], "/b": [400]})

    def send(path: str, allow: Allowlist = LOOPBACK):  # noqa: ANN202
        return attempt(receiver.url + path, "msg_1", b"{}", receiver.secret, allow, 2.0, "completed")

    assert send("/ok").outcome == "delivered"
    redirect = send("/r")
    assert (
        redirect.outcome == "failed"
        and redirect.status_code == 302
        and "not followed" in (redirect.message or "")
    )
    assert send("/t").outcome == "retry"
    assert send("/g").outcome == "gone"
    assert send("/b").outcome == "failed"
    refused = send("/ok", Allowlist())  # loopback is not public: re-checked at delivery
    assert refused.outcome == "failed" and "refused" in (refused.message or "")
    receiver.verify_all()
    assert all(c.headers["host"] == receiver.url.removeprefix("http://") for c in receiver.received())


def test_connection_error_is_retried() -> None:
    from shared.redis_server import free_port

    result = attempt(
        f"http://127.0.0.1:{free_port()}/x", "msg_1", b"{}", "whsec_AAAA", LOOPBACK, 1.0, "start"
    )
    assert result.outcome == "retry" and result.status_code is None
