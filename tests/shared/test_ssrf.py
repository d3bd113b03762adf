"""The SSRF guard: non-public addresses refused unless allowlisted; DNS answers judged, not host names."""

import pytest

from shared.ssrf import Allowlist, UnsafeWebhookUrl, check_url


def resolver(answers: dict[str, list[str]]):  # noqa: ANN201
    return lambda host, port: answers[host]


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",
        "224.0.0.1",
        "240.0.0.1",
        "0.0.0.0",
        "100.64.0.1",
        "::1",
        "fe80::1",
        "fc00::1",
        "ff02::1",
        "::ffff:127.0.0.1",
    ],
)
def test_non_public_addresses_are_refused(address: str) -> None:
    with pytest.raises(UnsafeWebhookUrl, match="non-public"):
        check_url("https://hooks.example.com/x", Allowlist(), resolver({"hooks.example.com": [address]}))


def test_public_address_passes_and_is_the_one_to_connect_to() -> None:
    target = check_url(
        "https://hooks.example.com:8443/x?a=1",
        Allowlist(),
        resolver({"hooks.example.com": ["93.184.216.34"]}),
    )
    assert (
        str(target.address) == "93.184.216.34" and target.port == 8443 and target.host == "hooks.example.com"
    )


def test_one_private_answer_among_public_ones_is_refused() -> None:
    with pytest.raises(UnsafeWebhookUrl):
        check_url("http://h.example/", Allowlist(), resolver({"h.example": ["93.184.216.34", "10.0.0.1"]}))


def test_literal_addresses_and_allowlist() -> None:
    with pytest.raises(UnsafeWebhookUrl):
        check_url("http://127.0.0.1:9000/hook", Allowlist())
    allow = Allowlist.parse(["127.0.0.0/8", "internal.example", " "])
    assert check_url("http://127.0.0.1:9000/hook", allow).port == 9000
    assert check_url("http://internal.example/", allow, resolver({"internal.example": ["10.0.0.7"]}))
    with pytest.raises(UnsafeWebhookUrl):
        check_url("http://[::1]:9000/", allow)  # the allowlist admits 127/8, not ::1


@pytest.mark.parametrize(
    "url", ["ftp://example.com/", "http:///nohost", "http://user:pw@example.com/", "http://[::1"]
)
def test_malformed_urls_are_refused(url: str) -> None:
    with pytest.raises(UnsafeWebhookUrl):
        check_url(url, Allowlist(), resolver({"example.com": ["93.184.216.34"]}))


def test_unresolvable_host_is_refused() -> None:
    def fail(host: str, port: int) -> list[str]:
        raise OSError("no such host")

    with pytest.raises(UnsafeWebhookUrl, match="cannot resolve"):
        check_url("http://nowhere.invalid/", Allowlist(), fail)
