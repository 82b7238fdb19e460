"""Which media URLs a worker may fetch: schemes, hosts, addresses and redirects (sans-io).

The worker fetches ``media_refs`` URLs the router forwards from its clients
(runtime/requests/media_fetch.py does the I/O). A URL a client chose must not
make the worker reach what only the worker can reach: its own loopback, the
cloud metadata service (link-local 169.254.169.254), the private network it
sits in. This module decides, with no I/O:

- ``check_url``: the scheme is one this worker accepts, the URL parses, its
  host is one of the operator's allowed domains (when there is a list), and a
  host given as a literal (an IP, ``localhost``) is public;
- ``classify_address``: why an address is not public (``None``: it is). The
  shell calls it on every address a name resolves to, right before it
  connects to that very address, so a name that resolves to a public address
  once and a private one the next time (DNS rebinding) cannot slip through:
  the address checked is the address connected to;
- ``redirect_target``: a redirect's Location, resolved against the URL that
  sent it, goes through ``check_url`` again (http/https only, a hop budget).

Rules: every refusal is a ``MediaRefused`` carrying a short ``reason`` (the
metrics label) and a message naming what was refused; the caller decides the
status (a refused URL is the client's fault). ``allow_private`` (the
operator's ``SMG_MM_ALLOW_PRIVATE_MEDIA_HOSTS=1``) turns the address checks
off and nothing else.

``allowed_domains`` (vLLM's ``--allowed-media-domains``) means what it means
to vLLM's ``MediaConnector``, which the reference servicer's fetcher is: the
URL's host must be one of the names exactly (no subdomains: ``example.com``
does not allow ``cdn.example.com``), compared without case (a hostname has
none) and without a trailing dot. vLLM checks the first URL only; here every
redirect's target is checked too, so an allowed origin cannot hand the fetch
to another host. An allowed host still passes the address checks.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

# Schemes fetched over the network; a redirect may only lead to one of these.
NETWORK_SCHEMES = ("http", "https")
# ``file`` joins these only where the operator named a local folder.
BASE_SCHEMES = ("http", "https", "data")
# Names every resolver maps to loopback (RFC 6761), refused without asking one.
LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")

# Ranges ``ipaddress``'s flags do not name on their own, with the reason each is refused.
_NAMED_RANGES = (
    (ipaddress.ip_network("100.64.0.0/10"), "shared_address_space"),  # carrier-grade NAT (RFC 6598)
    (ipaddress.ip_network("198.18.0.0/15"), "benchmarking"),  # RFC 2544
    (ipaddress.ip_network("255.255.255.255/32"), "broadcast"),
    (ipaddress.ip_network("fc00::/7"), "unique_local"),  # RFC 4193
    (ipaddress.ip_network("64:ff9b:1::/48"), "nat64_local_use"),  # RFC 8215
)
# IPv6 forms that carry an IPv4 address a packet may end up at: judged by that address.
_NAT64_WELL_KNOWN = ipaddress.ip_network("64:ff9b::/96")


# A URL longer than this is refused before it is parsed (a data: URL is bounded by its item bytes instead).
URL_BYTES_MAX = 8192
# How much of a URL a message shows: a refusal must not echo megabytes back (or into the journal).
URL_SHOWN_CHARS = 200


def shown(url: str) -> str:
    """``url`` for a message: quoted, and cut to ``URL_SHOWN_CHARS``."""
    return repr(url if len(url) <= URL_SHOWN_CHARS else url[:URL_SHOWN_CHARS] + "…")


class MediaRefused(Exception):
    """A URL (or an address it led to) this worker will not fetch: the client's fault."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class MediaPolicy:
    """What the operator allows (``runtime/contracts/shared/media.py`` reads it from flags and env)."""

    allow_private: bool = False
    # ``file`` URLs are fetched only under this folder; None: ``file`` is not accepted.
    allowed_local_path: str | None = None
    redirects_max: int = 5
    # http(s) hosts fetched from, as ``normalize_domain`` gives them; empty: any (the address checks still apply).
    allowed_domains: tuple[str, ...] = ()

    @property
    def schemes(self) -> tuple[str, ...]:
        return BASE_SCHEMES + (("file",) if self.allowed_local_path else ())


@dataclass(frozen=True)
class MediaUrl:
    """A URL ``check_url`` accepted."""

    url: str
    scheme: str
    host: str  # "" for data: and file:
    port: int | None


def classify_address(address: str | ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why ``address`` is not a public unicast address (the refusal's reason), or None when it is."""
    ip = ipaddress.ip_address(address) if isinstance(address, str) else address
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is None and ip in _NAT64_WELL_KNOWN:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            return classify_address(embedded)
        if ip.scope_id:
            return "link_local"
    for network, reason in _NAMED_RANGES:
        if ip.version == network.version and ip in network:
            return reason
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link_local"
    if ip.is_multicast:
        return "multicast"
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_reserved:
        return "non_public"
    if ip.is_private:
        return "private"
    if not ip.is_global:
        return "non_public"
    return None


def check_address(host: str, address: str, policy: MediaPolicy) -> None:
    """Refuse connecting to ``address`` (what ``host`` resolved to) unless it is public or the policy allows."""
    if policy.allow_private:
        return
    reason = classify_address(address)
    if reason is not None:
        where = f"is {address}" if host.strip("[]") == address else f"resolves to {address}"
        raise MediaRefused(
            reason,
            f"host {host!r} {where}, a {reason.replace('_', '-')} address this worker does not "
            "fetch from (SMG_MM_ALLOW_PRIVATE_MEDIA_HOSTS=1 allows it)",
        )


def check_url(url: str, policy: MediaPolicy) -> MediaUrl:
    """The URL parsed, when its scheme is accepted and its host (if a literal) may be fetched from."""
    if not url:
        raise MediaRefused("bad_url", "url must not be empty")
    if len(url) > URL_BYTES_MAX and not url[:5].lower() == "data:":
        raise MediaRefused("bad_url", f"url is {len(url)} characters; at most {URL_BYTES_MAX}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as error:
        raise MediaRefused("bad_url", f"url does not parse: {error}") from None
    scheme = parts.scheme.lower()
    if scheme not in policy.schemes:
        raise MediaRefused(
            "scheme",
            f"url scheme {scheme!r} is not accepted by this worker (accepted: {', '.join(policy.schemes)})",
        )
    if scheme not in NETWORK_SCHEMES:
        return MediaUrl(url=url, scheme=scheme, host="", port=None)
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise MediaRefused("bad_url", "url names no host")
    if policy.allowed_domains and normalize_domain(host) not in policy.allowed_domains:
        raise MediaRefused(
            "domain",
            f"host {host!r} is not one of the allowed media domains ({', '.join(policy.allowed_domains)}; "
            "--allowed-media-domains)",
        )
    if not policy.allow_private:
        if host in LOOPBACK_NAMES or host.endswith(".localhost"):
            raise MediaRefused(
                "loopback",
                f"host {host!r} is a loopback name this worker does not fetch from "
                "(SMG_MM_ALLOW_PRIVATE_MEDIA_HOSTS=1 allows it)",
            )
        literal = _ip_literal(host)
        if literal is not None:
            check_address(host, literal, policy)
    return MediaUrl(url=url, scheme=scheme, host=host, port=port)


def normalize_domain(name: str) -> str:
    """A host name as the allowed-domains check compares it: no case, no trailing dot, no IPv6 brackets."""
    return name.strip().strip("[]").rstrip(".").lower()


def redirect_target(url: str, location: str | None, hops: int, policy: MediaPolicy) -> MediaUrl:
    """Where a redirect from ``url`` leads (its ``hops``-th), checked as the first URL was."""
    if hops > policy.redirects_max:
        raise MediaRefused("redirects", f"more than {policy.redirects_max} redirects")
    if not location:
        raise MediaRefused("redirects", "a redirect without a Location")
    target = urljoin(url, location)
    scheme = urlsplit(target).scheme.lower()
    if scheme not in NETWORK_SCHEMES:
        # A server may not turn a fetch into a read of the worker's files or an inline payload.
        raise MediaRefused("redirects", f"a redirect to scheme {scheme!r}; only http and https are followed")
    try:
        return check_url(target, policy)
    except MediaRefused as error:
        raise MediaRefused(error.reason, f"redirected to {shown(target)}: {error}") from None


def _ip_literal(host: str) -> str | None:
    """``host`` as an IP address when it is one, in any form a resolver would also take as one."""
    try:
        return str(ipaddress.ip_address(host.strip("[]").split("%")[0]))
    except ValueError:
        pass
    return _inet_aton(host)


_INET_PART = re.compile(r"0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*")


def _inet_aton(host: str) -> str | None:
    """inet_aton's forms, which getaddrinfo also takes as an address: 2130706433, 0x7f000001, 0177.0.0.1 and
    127.1 all mean 127.0.0.1 (parsed here, not by the socket module: this layer does no I/O)."""
    parts = host.split(".")
    if not 1 <= len(parts) <= 4 or not all(_INET_PART.fullmatch(part) for part in parts):
        return None
    values = [int(part, 16) if part[:2].lower() == "0x" else int(part, 8) if part.startswith("0") else int(part)
              for part in parts]  # fmt: skip
    # The last part fills every byte the earlier ones left (a.b: 8 bits then 24; a.b.c: 8, 8, 16).
    last_bits = 8 * (5 - len(values))
    if any(value > 255 for value in values[:-1]) or values[-1] >= 1 << last_bits:
        return None
    number = values[-1]
    for position, value in enumerate(values[:-1]):
        number |= value << (24 - 8 * position)
    return str(ipaddress.IPv4Address(number))
