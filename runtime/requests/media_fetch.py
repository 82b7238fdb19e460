"""Fetching media refs: data, file and http(s) URLs under the SSRF policy and the size and time caps.

The policy (which schemes, hosts, addresses, redirects) is sans-io in
``machines/media_policy.py``; this is the I/O around it, trio all through:

- http(s) through httpx (redirects followed here, one hop at a time, each
  Location checked by ``redirect_target`` before it is fetched), over a
  connection pool whose network backend resolves the host itself, checks
  every address the name resolves to, and connects to the checked address
  (``GuardedBackend``): what was checked is what is connected to, so a name
  that resolves differently the second time (DNS rebinding) is judged on
  the answer actually used. TLS still verifies the certificate against the
  URL's host (httpcore sends the origin's name as SNI, not the address).
  No proxies from the environment (``trust_env=False``): a proxy would make
  the connect-time check judge the proxy, not the origin;
- bodies are read in chunks and refused as soon as they pass
  ``item_bytes_max`` (a Content-Length above it is refused before reading);
- each item runs under one deadline (``fetch_deadline``: its modality's),
  connect to last byte, so a slow-drip origin cannot hold a job slot;
- ``data:`` is decoded with its size judged from its length first;
  ``file:`` only under the operator's folder, after symlinks are resolved.

httpx's ``AsyncHTTPTransport`` (0.28 and 0.29) takes no network backend:
``_guarded_transport`` swaps its pool for one built with ours (the pin in
pyproject.toml names the versions this was read against).
"""

from __future__ import annotations

import base64
import io
import os
import time
from dataclasses import dataclass
from urllib.parse import unquote, unquote_to_bytes, urlsplit

import httpcore
import httpx
import trio

from enginelink.machines.media_policy import (
    MediaPolicy, MediaRefused, check_address, check_url, redirect_target, shown,
)  # fmt: skip
from enginelink.runtime.errors import ClientError, ServicerError, Unavailable
from enginelink.runtime.requests.local_files import LocalFileRefused, read_regular

# How many connections the fetcher keeps open at once (all origins together).
POOL_CONNECTIONS_MAX = 64
REDIRECT_STATUSES = (301, 302, 303, 307, 308)


@dataclass(frozen=True)
class FetchedMedia:
    modality: str
    data: bytes
    content_type: str


class _OriginFault(Exception):
    """The origin failed (timeout, 5xx, broken transfer): the router should try again later or elsewhere."""


class _Saturated(Exception):
    """This worker holds as many fetched bytes as it may: the router should retry elsewhere."""


class _Job:
    """One request's fetches: the bytes they hold of the worker's budget, given back when they end."""

    held = 0


class _CallerFault(Exception):
    """The URL or what it gave is wrong (4xx, refused connection, unresolvable, too large, wrong media)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# -- the network: resolve, check, connect ------------------------------------------


async def _resolve(host: str, port: int) -> list[str]:
    infos = await trio.socket.getaddrinfo(host, port, type=trio.socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


async def _connect(address: str, port: int, timeout, local_address, socket_options):
    return await httpcore.TrioBackend().connect_tcp(address, port, timeout, local_address, socket_options)


class GuardedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's trio backend, connecting only to addresses the policy allows (checked at connect time)."""

    def __init__(self, policy: MediaPolicy, resolve=_resolve, connect=_connect) -> None:
        self.policy = policy
        self.resolve = resolve
        self.connect = connect

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        try:
            addresses = await self.resolve(host, port)
        except OSError as error:
            raise _CallerFault("unresolvable", f"host {host!r} does not resolve ({error})") from None
        if not addresses:
            raise _CallerFault("unresolvable", f"host {host!r} does not resolve")
        # Every address the name has, not only the one tried first: a name with one public and
        # one private address must not reach the private one on a retry or a reconnect.
        for address in addresses:
            check_address(host, address, self.policy)
        return await self.connect(addresses[0], port, timeout, local_address, socket_options)

    async def connect_unix_socket(self, path, timeout=None, socket_options=None):  # pragma: no cover - never asked
        raise _CallerFault("scheme", "unix sockets are not fetched from")

    async def sleep(self, seconds: float) -> None:
        await trio.sleep(seconds)


def _guarded_transport(backend: GuardedBackend) -> httpx.AsyncHTTPTransport:
    transport = httpx.AsyncHTTPTransport(trust_env=False, retries=0)
    transport._pool = httpcore.AsyncConnectionPool(
        ssl_context=httpx.create_ssl_context(), max_connections=POOL_CONNECTIONS_MAX, http1=True, http2=False,
        network_backend=backend,
    )  # fmt: skip
    return transport


# -- the fetcher -------------------------------------------------------------------


class Fetcher:
    def __init__(self, settings, metrics, network=None) -> None:
        self.settings = settings
        self.policy: MediaPolicy = settings.policy
        self.metrics = metrics
        resolve, connect = network or (_resolve, _connect)
        self.backend = GuardedBackend(self.policy, resolve, connect)
        self.bytes_held = 0  # all jobs' fetched bytes, against ENGINELINK_MM_MAX_BYTES_IN_FLIGHT
        # httpx's own bound is per operation; each item's deadline is the trio scope in ``fetch``.
        longest_s = max(settings.fetch_deadline(modality)[0] for modality in ("image", "video", "audio"))
        self.client = httpx.AsyncClient(transport=_guarded_transport(self.backend), follow_redirects=False,
                                        trust_env=False, timeout=httpx.Timeout(longest_s))  # fmt: skip

    async def fetch_all(self, refs: list[tuple[str, str]]) -> list[FetchedMedia]:
        """Every ref, fetched concurrently; the first failure cancels the rest and is raised."""
        results: list[FetchedMedia | None] = [None] * len(refs)
        failures: list[ServicerError] = []
        job = _Job()

        async def one(index: int, modality: str, url: str) -> None:
            try:
                results[index] = await self.fetch(index, modality, url, job)
            except ServicerError as error:
                # The first failure is the call's answer; the other fetches stop now.
                failures.append(error)
                nursery.cancel_scope.cancel()

        try:
            async with trio.open_nursery() as nursery:
                for index, (modality, url) in enumerate(refs):
                    nursery.start_soon(one, index, modality, url)
        finally:
            # The items go to the caller and are dropped with its call; held no longer.
            self.bytes_held -= job.held
            self.metrics.set_bytes_held(self.bytes_held)
        if failures:
            raise failures[0]
        return results  # type: ignore[return-value]

    def _take(self, job: _Job, count: int) -> None:
        """Count ``count`` more fetched bytes against the worker's budget, or refuse (capacity, not the caller)."""
        cap = self.settings.bytes_in_flight_max
        if self.bytes_held + count > cap:
            raise _Saturated(f"the media being fetched on this worker would pass {cap} bytes "
                             "(ENGINELINK_MM_MAX_BYTES_IN_FLIGHT); retry on another worker")  # fmt: skip
        self.bytes_held += count
        job.held += count
        self.metrics.set_bytes_held(self.bytes_held)

    async def fetch(self, index: int, modality: str, url: str, job: _Job) -> FetchedMedia:
        """One item, or the error whose fault it is, naming the item."""
        name = f"media_refs.items[{index}]"
        scheme = _scheme_label(url)
        started = time.perf_counter()
        timeout_s, timeout_name = self.settings.fetch_deadline(modality)
        try:
            with trio.fail_after(timeout_s):
                media_url = check_url(url, self.policy)
                data, content_type = await self._get(media_url, job)
            # Off the event loop: an image's header parse is CPU work of unbounded-ish cost.
            await trio.to_thread.run_sync(check_media, modality, data, content_type)
        except MediaRefused as error:
            self.metrics.refused(error.reason)
            self.metrics.fetched(scheme, "refused", None)
            raise ClientError(name, str(error)) from None
        except _CallerFault as error:
            self.metrics.refused(error.reason)
            self.metrics.fetched(scheme, "client_error", time.perf_counter() - started)
            raise ClientError(name, str(error)) from None
        except trio.TooSlowError:
            self.metrics.fetched(scheme, "origin_error", time.perf_counter() - started)
            raise Unavailable(f"{name}: the fetch took longer than {timeout_s:g} s ({timeout_name})",
                              reason="media_fetch") from None  # fmt: skip
        except _OriginFault as error:
            self.metrics.fetched(scheme, "origin_error", time.perf_counter() - started)
            raise Unavailable(f"{name}: {error}", reason="media_fetch") from None
        except _Saturated as error:
            self.metrics.refused("bytes_saturated")
            self.metrics.fetched(scheme, "saturated", None)
            raise Unavailable(f"{name}: {error}", reason="media_saturated") from None
        self.metrics.fetched(scheme, "ok", time.perf_counter() - started)
        return FetchedMedia(modality, data, content_type)

    async def _get(self, media_url, job: _Job) -> tuple[bytes, str]:
        if media_url.scheme in ("data", "file"):
            if media_url.scheme == "data":
                data, content_type = decode_data_url(media_url.url, self.settings.item_bytes_max)
            else:
                data, content_type = await read_local(media_url.url, self.policy.allowed_local_path,
                                                      self.settings.item_bytes_max)  # fmt: skip
            self._take(job, len(data))
            return data, content_type
        hops = 0
        while True:
            try:
                data, content_type, location = await self._one_hop(media_url.url, job)
            except MediaRefused as error:
                if hops == 0:
                    raise
                # Refused at connect time after a redirect: say so, the client sent another URL.
                raise MediaRefused(error.reason, f"redirected to {shown(media_url.url)}: {error}") from None
            if location is None:
                return data, content_type
            hops += 1
            media_url = redirect_target(media_url.url, location, hops, self.policy)

    async def _one_hop(self, url: str, job: _Job) -> tuple[bytes, str, str | None]:
        """(body, content type, None), or (b"", "", Location) for a redirect."""
        cap = self.settings.item_bytes_max
        try:
            async with self.client.stream("GET", url) as response:
                status = response.status_code
                if status in REDIRECT_STATUSES:
                    return b"", "", response.headers.get("location", "")
                if 400 <= status < 500:
                    raise _CallerFault("http_4xx", f"the origin answered {status} for {shown(url)}")
                if status >= 500 or status < 200 or status >= 300:
                    raise _OriginFault(f"the origin answered {status} for {shown(url)}")
                length = response.headers.get("content-length")
                if length is not None and length.isdigit() and int(length) > cap:
                    raise _CallerFault("too_large", f"is {length} bytes; at most {cap} (SMG_VLLM_MM_MAX_ITEM_BYTES)")
                body = bytearray()
                # As the network gives it (httpcore reads at most 64 KiB at a time): the caps act at once.
                async for chunk in response.aiter_raw():
                    body += chunk
                    self._take(job, len(chunk))
                    if len(body) > cap:
                        raise _CallerFault("too_large", f"is over {cap} bytes (SMG_VLLM_MM_MAX_ITEM_BYTES)")
                return bytes(body), response.headers.get("content-type", ""), None
        except httpx.ConnectError as error:
            raise _CallerFault("connect", f"could not connect to {shown(url)}: {error}") from None
        except httpx.TimeoutException as error:
            raise _OriginFault(f"timed out fetching {shown(url)} ({type(error).__name__})") from None
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as error:
            raise _OriginFault(f"the transfer of {shown(url)} broke: {error}") from None
        except httpx.UnsupportedProtocol as error:  # checked before; httpx agreeing is belt and braces
            raise _CallerFault("scheme", str(error)) from None
        except httpx.InvalidURL as error:
            # httpx builds a redirect's next request even when not following it, and refuses a
            # Location it cannot parse (``data:...`` without a slash, say) before we see the response.
            raise _CallerFault("redirects", f"{shown(url)} or a redirect from it names a URL that cannot be fetched "
                               f"({error})") from None


def _scheme_label(url: str) -> str:
    """The metrics label of a URL's scheme: one of a closed set, whatever the client wrote."""
    scheme = url.partition(":")[0].lower() if ":" in url[:16] else ""
    return scheme if scheme in ("http", "https", "data", "file") else "other"


# -- data: and file: ---------------------------------------------------------------


def decode_data_url(url: str, cap: int) -> tuple[bytes, str]:
    """``data:[<type>][;base64],<payload>`` decoded, its size judged before decoding (RFC 2397)."""
    head, comma, payload = url[5:].partition(",")
    if not comma:
        raise _CallerFault("bad_url", "a data: URL without a comma")
    params = head.split(";")
    is_base64 = params[-1].strip().lower() == "base64"
    content_type = params[0].strip().lower() if params[0] and "=" not in params[0] else "text/plain"
    # The decoded size is at most this (base64: 3 bytes per 4 characters; percent-encoding only shrinks).
    bound = len(payload) * 3 // 4 if is_base64 else len(payload)
    if bound > cap + 3:
        raise _CallerFault("too_large", f"decodes to about {bound} bytes; at most {cap} (SMG_VLLM_MM_MAX_ITEM_BYTES)")
    try:
        data = base64.b64decode(unquote(payload), validate=True) if is_base64 else unquote_to_bytes(payload)
    except ValueError as error:
        raise _CallerFault("bad_url", f"a data: URL whose base64 does not decode ({error})") from None
    if len(data) > cap:
        raise _CallerFault("too_large", f"decodes to {len(data)} bytes; at most {cap} (SMG_VLLM_MM_MAX_ITEM_BYTES)")
    return data, content_type


async def read_local(url: str, folder: str | None, cap: int) -> tuple[bytes, str]:
    """A ``file:`` URL's bytes, only when it resolves (symlinks followed) to a regular file under ``folder``.

    Never a FIFO, device or directory, and never a blocking open (``local_files.py``): a FIFO
    under the folder used to hold a worker thread past every timeout. The thread is abandoned
    when the fetch's time runs out, so the call answers in time even if the disk does not."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise _CallerFault("bad_url", "a file: URL must name no host")
    path = unquote(parts.path)
    if "\x00" in path:
        raise _CallerFault("bad_url", "a file: URL whose path holds a NUL byte (%00)")

    def read() -> bytes:
        root = os.path.realpath(folder or "/nonexistent")
        real = os.path.realpath(path)
        if os.path.commonpath([root, real]) != root:
            raise _CallerFault("outside_local_path", "a file: URL outside ENGINELINK_ALLOWED_LOCAL_MEDIA_PATH")
        try:
            data = read_regular(real, cap=cap).data
        except LocalFileRefused as error:
            raise _CallerFault("bad_url", f"a file: URL that names no regular file (it {error})") from None
        except OSError as error:
            raise _CallerFault("bad_url", f"a file: URL that cannot be read ({error.strerror})") from None
        if len(data) > cap:
            raise _CallerFault("too_large", f"is over {cap} bytes (SMG_VLLM_MM_MAX_ITEM_BYTES)")
        return data

    return await trio.to_thread.run_sync(read, abandon_on_cancel=True), ""


# -- is it what it says --------------------------------------------------------------


def check_media(modality: str, data: bytes, content_type: str) -> None:
    """Refuse a body that is not the modality's media (an HTML error page sent with 200, say)."""
    if not data:
        raise _CallerFault("wrong_media", f"an empty body where an {modality} was expected")
    if modality == "image":
        from PIL import Image, UnidentifiedImageError

        try:
            # verify() reads the header and structure, not the pixels: cheap, and
            # Pillow's decompression-bomb guard refuses absurd dimensions.
            with Image.open(io.BytesIO(data)) as image:
                image.verify()
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
            raise _CallerFault("wrong_media", f"is not an image this worker can read ({error})") from None
        return
    kind = content_type.split(";")[0].strip().lower()
    if kind and not (kind.startswith(modality + "/") or kind == "application/octet-stream"):
        raise _CallerFault("wrong_media", f"is {kind!r}, not {modality}")
