"""SSRF guard for webhook URLs: refuse hosts that resolve to addresses inside our network.

A URL is refused when any address its host resolves to is loopback, private, link-local, multicast,
reserved, unspecified or otherwise not globally routable (IPv4-mapped IPv6 judged as the IPv4 inside),
unless the allowlist (settings.webhook_allow_hosts: host names or CIDRs) admits the host or the address.
The gateway checks at submit (422); delivery checks again (DNS may have changed) and connects to the
address it checked, so a rebinding DNS answer between check and connect cannot redirect it.
"""

import ipaddress
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], list[str]]


class UnsafeWebhookUrl(ValueError):
    """The webhook URL is malformed, unresolvable or points inside our network."""


@dataclass(frozen=True)
class Allowlist:
    hosts: frozenset[str] = frozenset()
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> "Allowlist":
        hosts, networks = set(), []
        for entry in entries:
            entry = entry.strip().lower()
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                hosts.add(entry.rstrip("."))
        return cls(frozenset(hosts), tuple(networks))

    def admits_host(self, host: str) -> bool:
        return host.lower().rstrip(".") in self.hosts

    def admits_address(self, address: IPAddress) -> bool:
        return any(address in network for network in self.networks if network.version == address.version)


def is_public(address: IPAddress) -> bool:
    """Globally routable unicast: not loopback, private, link-local, multicast, reserved or unspecified."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return is_public(address.ipv4_mapped)
    return address.is_global and not (
        address.is_multicast
        or address.is_loopback
        or address.is_private
        or address.is_link_local
        or address.is_reserved
        or address.is_unspecified
    )


def system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@dataclass(frozen=True)
class Target:
    """A checked webhook URL: where to connect (`address`) and what to ask for."""

    url: str
    scheme: str
    host: str
    port: int
    address: IPAddress  # the first permitted address the host resolved to


def check_url(url: str, allow: Allowlist, resolve: Resolver = system_resolver) -> Target:
    """Resolve the URL's host and return where to connect, or raise UnsafeWebhookUrl."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise UnsafeWebhookUrl(f"malformed URL: {exc}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UnsafeWebhookUrl("the webhook must be an http(s) URL with a host")
    if parts.username or parts.password:
        raise UnsafeWebhookUrl("the webhook URL must not carry credentials")
    host = parts.hostname
    port = port or (443 if parts.scheme == "https" else 80)
    try:
        literal: IPAddress | None = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    try:
        addresses = (
            [literal] if literal else [ipaddress.ip_address(a.split("%")[0]) for a in resolve(host, port)]
        )
    except (OSError, UnicodeError, ValueError) as exc:
        raise UnsafeWebhookUrl(f"cannot resolve {host}: {exc}") from exc
    if not addresses:
        raise UnsafeWebhookUrl(f"{host} resolves to no address")
    if not allow.admits_host(host):
        refused = [a for a in addresses if not is_public(a) and not allow.admits_address(a)]
        if refused:
            raise UnsafeWebhookUrl(
                f"{host} resolves to {refused[0]}, a non-public address (loopback, private, link-local, "
                "multicast or reserved); add it to webhook_allow_hosts to permit it"
            )
    return Target(url=url, scheme=parts.scheme, host=host, port=port, address=addresses[0])
