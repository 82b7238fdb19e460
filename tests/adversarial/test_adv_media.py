"""Media refs as an attack surface: SSRF (literals, names, rebinding, redirects), sizes, counts, time, origins.

The fetcher (runtime/requests/media_fetch.py) runs for real against a
loopback origin started here (``media_origin.py``). Where a test needs a
*public* host, DNS and routing are stood in for (``network=``): a resolver
that answers chosen addresses for chosen names, and a connector that routes
a public address (93.184.216.34) to the loopback origin, the way a NAT would. The policy's checks are the real ones; only
the world around them is staged.

Each property is attacked several ways: private hosts as literals (dotted,
integer, hex, IPv6, IPv4-mapped, NAT64, 6to4), as names (localhost,
resolving to private, resolving to public then private), via redirects (to
a literal, to a name, to file:/data:, too many); size by Content-Length, by
an endless chunked body and by a data: URL; time by a stalled body; the
origin's faults by 500 and a broken transfer; the caller's by 404, an HTML
page, a bad data: URL.
"""

from __future__ import annotations

import base64
import os

import pytest
import trio
from prometheus_client import CollectorRegistry
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2 as pb

from enginelink.runtime.errors import ClientError, Precondition, Unavailable
from enginelink.runtime.contracts.shared.media import MediaKnobError, MediaService, MediaSettings, media_settings_from
from tests.adversarial.media_origin import PNG, Origin

PUBLIC = "93.184.216.34"  # stands for a public origin; connections to it go to the loopback origin


@pytest.fixture
def origin():
    with Origin() as running:
        yield running


def _service(origin: Origin | None = None, names: dict[str, list[list[str]]] | None = None,
             registry: CollectorRegistry | None = None, **knobs) -> MediaService:  # fmt: skip
    """A media service on ``knobs``; ``names``: host → successive resolver answers (the last repeats)."""
    settings = MediaSettings(processor="inprocess", **knobs)
    if names is None:
        return MediaService(settings, registry=registry)
    answers = {host: list(values) for host, values in names.items()}
    connected: list[str] = []

    async def resolve(host, port):
        if host not in answers:
            raise OSError(f"[Errno -2] Name or service not known: {host}")
        queue = answers[host]
        return queue.pop(0) if len(queue) > 1 else queue[0]

    async def connect(address, port, timeout, local_address, socket_options):
        import httpcore

        connected.append(address)
        target = "127.0.0.1" if address == PUBLIC else address
        return await httpcore.TrioBackend().connect_tcp(target, origin.port if origin else port, timeout,
                                                        local_address, socket_options)  # fmt: skip

    service = MediaService(settings, registry=registry, network=(resolve, connect))
    service.connected = connected
    return service


def _refs(*urls: str, modality=common_pb2.IMAGE) -> pb.MediaRefs:
    return pb.MediaRefs(items=[pb.MediaRef(modality=modality, url=url) for url in urls])


async def _fetch(service: MediaService, *urls: str, modality=common_pb2.IMAGE):
    return await service.fetcher.fetch_all(service.check_refs(_refs(*urls, modality=modality)))


async def _refused(service, *urls, modality=common_pb2.IMAGE) -> ClientError:
    with pytest.raises(ClientError) as error:
        await _fetch(service, *urls, modality=modality)
    return error.value


# -- SSRF: literals ------------------------------------------------------------------


@pytest.mark.parametrize("host,reason", [
    ("127.0.0.1", "loopback"), ("localhost", "loopback"), ("LOCALHOST.", "loopback"), ("a.localhost", "loopback"),
    ("2130706433", "loopback"), ("0x7f000001", "loopback"), ("0177.0.0.1", "loopback"), ("127.1", "loopback"),
    ("[::1]", "loopback"), ("[::ffff:127.0.0.1]", "loopback"), ("[64:ff9b::7f00:1]", "loopback"),
    ("[2002:7f00:1::]", "loopback"), ("169.254.169.254", "link-local"), ("[fe80::1]", "link-local"),
    ("10.1.2.3", "private"), ("172.16.0.1", "private"), ("192.168.1.1", "private"),
    ("100.64.0.1", "shared-address-space"), ("[fd00::1]", "unique-local"), ("224.0.0.1", "multicast"),
    ("0.0.0.0", "unspecified"), ("198.18.0.1", "benchmarking"), ("255.255.255.255", "broadcast"),
])  # fmt: skip
async def test_a_private_host_literal_is_refused_before_any_connection(origin, host, reason):
    service = _service(origin, names={})
    error = await _refused(service, f"http://{host}:{origin.port}/cat.png")
    assert error.field == "media_refs.items[0]"
    assert reason in str(error) and "SMG_MM_ALLOW_PRIVATE_MEDIA_HOSTS" in str(error)
    assert service.connected == [] and origin.hits == []


async def test_a_name_resolving_to_a_private_address_is_refused_at_connect_time(origin):
    service = _service(origin, names={"intranet.example": [["10.0.0.5"]], "mixed.example": [[PUBLIC, "127.0.0.1"]]})
    error = await _refused(service, f"http://intranet.example:{origin.port}/cat.png")
    assert "resolves to 10.0.0.5" in str(error) and "private" in str(error)
    # One public and one private address: refused, not raced.
    error = await _refused(service, f"http://mixed.example:{origin.port}/cat.png")
    assert "127.0.0.1" in str(error)
    assert service.connected == [] and origin.hits == []


async def test_dns_rebinding_is_judged_on_the_answer_connected_to(origin):
    # Public the first time (fetched), loopback the next: the second fetch must not reach it.
    service = _service(origin, names={"rebind.example": [[PUBLIC], ["127.0.0.1"]]})
    url = f"http://rebind.example:{origin.port}/cat.png"
    [item] = await _fetch(service, url)
    assert item.data == PNG
    await service.fetcher.client.aclose()  # no kept-alive connection: the next fetch resolves again
    service = _service(origin, names={"rebind.example": [["127.0.0.1"]]})
    error = await _refused(service, url)
    assert "loopback" in str(error)
    assert service.connected == []


async def test_a_public_name_is_fetched(origin):
    registry = CollectorRegistry()
    service = _service(origin, names={"cdn.example": [[PUBLIC]]}, registry=registry)
    [item] = await _fetch(service, f"http://cdn.example:{origin.port}/cat.png")
    assert (item.modality, item.data, item.content_type) == ("image", PNG, "image/png")
    assert registry.get_sample_value("smg_servicer_media_fetches_total", {"scheme": "http", "outcome": "ok"}) == 1
    assert registry.get_sample_value("smg_servicer_media_fetch_seconds_count", {"scheme": "http"}) == 1


# -- SSRF: redirects ------------------------------------------------------------------


@pytest.mark.parametrize("location,words", [
    ("http://127.0.0.1:{port}/cat.png", "loopback"),
    ("http://169.254.169.254/latest/meta-data/", "link-local"),
    ("http://intranet.example:{port}/cat.png", "private"),
    ("http://[::1]:{port}/cat.png", "loopback"),
    ("file:///etc/passwd", "scheme 'file'"),
    ("data:image/png;base64,AAAA", "cannot be fetched"),  # httpx refuses to parse it as a redirect
    ("data:/image/png;base64,AAAA", "scheme 'data'"),
    ("gopher://cdn.example/x", "scheme 'gopher'"),
])  # fmt: skip
async def test_a_redirect_to_a_private_or_non_http_target_is_refused(origin, location, words):
    origin.redirect("/hop", location.format(port=origin.port))
    service = _service(origin, names={"cdn.example": [[PUBLIC]], "intranet.example": [["192.168.7.7"]]})
    error = await _refused(service, f"http://cdn.example:{origin.port}/hop")
    assert words in str(error) and "redirect" in str(error), str(error)
    assert service.connected == [PUBLIC]  # the first hop only


async def test_redirects_within_public_hosts_are_followed_up_to_the_budget(origin):
    for index in range(4):
        origin.redirect(f"/r{index}", f"/r{index + 1}", status=301 if index % 2 else 307)
    origin.redirect("/r4", "/cat.png")
    service = _service(origin, names={"cdn.example": [[PUBLIC]]}, redirects_max=5)
    [item] = await _fetch(service, f"http://cdn.example:{origin.port}/r0")
    assert item.data == PNG
    service = _service(origin, names={"cdn.example": [[PUBLIC]]}, redirects_max=3)
    error = await _refused(service, f"http://cdn.example:{origin.port}/r0")
    assert "more than 3 redirects" in str(error)
    origin.redirect("/loop", "/loop")
    error = await _refused(service, f"http://cdn.example:{origin.port}/loop")
    assert "more than 3 redirects" in str(error)


# -- --allowed-media-domains -----------------------------------------------------------


async def test_only_the_allowed_domains_are_fetched_from(origin):
    names = {"cdn.example": [[PUBLIC]], "other.example": [[PUBLIC]], "a.cdn.example": [[PUBLIC]]}
    service = _service(origin, names=names, allowed_domains=("cdn.example",))
    [item] = await _fetch(service, f"http://CDN.example:{origin.port}/cat.png")
    assert item.data == PNG
    for index, host in enumerate(("other.example", "a.cdn.example")):
        error = await _refused(service, f"http://cdn.example:{origin.port}/cat.png",
                               f"http://{host}:{origin.port}/refused.png")
        assert error.field == "media_refs.items[1]", error.field
        assert f"host {host!r} is not one of the allowed media domains (cdn.example" in str(error)
    assert "/refused.png" not in origin.hits  # refused before any connection


async def test_a_redirect_out_of_the_allowed_domains_is_refused_before_it_is_fetched(origin):
    origin.redirect("/away", f"http://other.example:{origin.port}/cat.png")
    origin.redirect("/stay", f"http://cdn.example:{origin.port}/cat.png", status=301)
    registry = CollectorRegistry()
    service = _service(origin, names={"cdn.example": [[PUBLIC]], "other.example": [[PUBLIC]]},
                       allowed_domains=("cdn.example",), registry=registry)
    error = await _refused(service, f"http://cdn.example:{origin.port}/away")
    assert error.field == "media_refs.items[0]"
    assert "redirected to" in str(error) and "'other.example' is not one of the allowed media domains" in str(error)
    assert origin.hits == ["/away"]  # the redirect's target was never asked for
    [item] = await _fetch(service, f"http://cdn.example:{origin.port}/stay")  # within the list: followed
    assert item.data == PNG
    assert registry.get_sample_value("smg_servicer_media_refusals_total", {"reason": "domain"}) == 1


def test_the_allowed_domains_knob():
    settings = media_settings_from({"ENGINELINK_ALLOWED_MEDIA_DOMAINS": "Example.com, cdn.example.org. example.com"})
    assert settings.allowed_domains == ("example.com", "cdn.example.org")
    assert settings.policy.allowed_domains == ("example.com", "cdn.example.org")
    assert media_settings_from({}).allowed_domains == ()


# -- the allow knob ------------------------------------------------------------------


async def test_the_allow_knob_lets_loopback_through_and_nothing_else_changes(origin):
    service = _service(allow_private=True)
    items = await _fetch(service, origin.url("/cat.png"), origin.url("/cat.png", host="localhost"))
    assert [item.data for item in items] == [PNG, PNG]
    error = await _refused(service, "ftp://127.0.0.1/x")
    assert "scheme 'ftp' is not accepted" in str(error)
    error = await _refused(service, origin.url("/page.html"))
    assert "not an image" in str(error)


# -- schemes, data: and file: ---------------------------------------------------------


async def test_data_urls_are_decoded_and_bounded(origin):
    service = _service(item_bytes_max=len(PNG))
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    [item] = await _fetch(service, url)
    assert item.data == PNG
    too_big = "data:image/png;base64," + base64.b64encode(PNG + b"x" * 64).decode()
    assert "SMG_VLLM_MM_MAX_ITEM_BYTES" in str(await _refused(service, too_big))
    assert "does not decode" in str(await _refused(service, "data:image/png;base64,@@@@"))
    assert "without a comma" in str(await _refused(service, "data:image/png;base64"))
    assert "not an image" in str(await _refused(service, "data:text/plain,hello"))


async def test_file_urls_only_under_the_allowed_folder(tmp_path):
    inside, outside = tmp_path / "media", tmp_path / "secret"
    inside.mkdir(), outside.mkdir()
    (inside / "cat.png").write_bytes(PNG)
    (outside / "key.png").write_bytes(PNG)
    os.symlink(outside / "key.png", inside / "link.png")
    error = await _refused(_service(), f"file://{inside}/cat.png")
    assert "scheme 'file' is not accepted" in str(error)  # off unless a folder is named
    service = _service(allowed_local_path=str(inside))
    [item] = await _fetch(service, f"file://{inside}/cat.png")
    assert item.data == PNG
    for url in (f"file://{outside}/key.png", f"file://{inside}/../secret/key.png", f"file://{inside}/link.png",
                "file:///etc/passwd"):
        assert "outside ENGINELINK_ALLOWED_LOCAL_MEDIA_PATH" in str(await _refused(service, url)), url
    assert "must name no host" in str(await _refused(service, f"file://evil.example{inside}/cat.png"))


async def test_file_urls_to_a_fifo_a_device_or_a_folder_are_refused_at_once(tmp_path):
    """Issue 38, item 3: open() of a FIFO blocked the fetch's thread past every timeout."""
    inside = tmp_path / "media"
    inside.mkdir()
    os.mkfifo(inside / "pipe.png")
    (inside / "folder.png").mkdir()
    service = _service(allowed_local_path=str(inside), fetch_timeout_s=30.0)
    with trio.fail_after(5):
        for name, words in (("pipe.png", "a FIFO"), ("folder.png", "a directory")):
            error = await _refused(service, f"file://{inside}/{name}")
            assert "media_refs.items[0]" in str(error) and words in str(error), str(error)


async def test_a_nul_in_a_file_url_is_the_callers_fault(tmp_path):
    """Issue 38, item 6: ``%00`` reached realpath ("embedded null byte") and was INTERNAL."""
    service = _service(allowed_local_path=str(tmp_path))
    error = await _refused(service, f"file://{tmp_path}/cat%00.png")
    assert "media_refs.items[0]" in str(error) and "NUL" in str(error)


# -- sizes, counts, saturation -------------------------------------------------------


async def test_an_oversized_body_is_refused_by_its_length_or_as_it_streams(origin):
    service = _service(allow_private=True, item_bytes_max=1024)
    origin.routes["/big.png"] = (200, {"Content-Type": "image/png"}, b"\0" * 4096)
    error = await _refused(service, origin.url("/big.png"))
    assert "4096 bytes; at most 1024" in str(error)
    error = await _refused(service, origin.url("/endless.png"))  # chunked: no length to judge by
    assert "over 1024 bytes" in str(error)


async def test_too_many_items_and_bad_items_are_refused_before_any_fetch(origin):
    service = _service(allow_private=True, items_max=2)
    url = origin.url("/cat.png")
    with pytest.raises(ClientError, match=r"3 image item\(s\); at most 2 per request on this worker "
                       r"\(--mm-max-items / SMG_VLLM_MM_MAX_ITEMS\)"):
        service.check_refs(_refs(url, url, url))
    # The cap is per modality, as the engine's own limits are: two images and two videos pass.
    mixed = _refs(url, url)
    mixed.items.extend(_refs(url, url, modality=common_pb2.VIDEO).items)
    assert [m for m, _ in service.check_refs(mixed)] == ["image", "image", "video", "video"]
    with pytest.raises(ClientError, match="has no items"):
        service.check_refs(_refs())
    with pytest.raises(ClientError, match=r"items\[1\]: url must not be empty"):
        service.check_refs(_refs(url, ""))
    with pytest.raises(ClientError, match="unsupported modality MODALITY_UNSPECIFIED"):
        service.check_refs(_refs(url, modality=common_pb2.MODALITY_UNSPECIFIED))
    assert origin.hits == []


async def test_processor_off_refuses_media_refs():
    service = MediaService(media_settings_from({}))
    with pytest.raises(ClientError, match=r"--mm-processor \(SMG_VLLM_MM_PROCESSOR\) is off"):
        await service.prepare(_refs("http://cdn.example/cat.png"))


async def test_at_the_inflight_cap_a_request_is_unavailable_at_once(origin):
    registry = CollectorRegistry()
    service = _service(allow_private=True, inflight_max=2, fetch_timeout_s=30, registry=registry)
    results = []

    async def stalled():
        try:
            await service.prepare(_refs(origin.url("/slow.png")))
        except Exception as error:  # noqa: BLE001 - collected for the assertion
            results.append(error)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stalled)
        nursery.start_soon(stalled)
        with trio.fail_after(10):
            while service.jobs < 2:
                await trio.sleep(0.01)
        with pytest.raises(Unavailable, match="SMG_VLLM_MM_MAX_INFLIGHT=2"):
            await service.prepare(_refs(origin.url("/cat.png")))
        assert registry.get_sample_value("smg_servicer_media_refusals_total", {"reason": "saturated"}) == 1
        assert registry.get_sample_value("smg_servicer_media_jobs_in_flight_max", {}) == 2
        nursery.cancel_scope.cancel()
    assert service.jobs == 0  # the slots came back when the jobs were cancelled


async def test_the_workers_fetched_bytes_are_bounded_across_requests(origin):
    registry = CollectorRegistry()
    service = _service(allow_private=True, bytes_in_flight_max=len(PNG) + 5, fetch_timeout_s=30, registry=registry)
    data_url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    # One image fits; a request of two does not (by a data: URL, then streamed over http).
    [item] = await _fetch(service, data_url)
    for second in (data_url, origin.url("/cat.png")):
        with pytest.raises(Unavailable, match="ENGINELINK_MM_MAX_BYTES_IN_FLIGHT"):
            await _fetch(service, data_url, second)
    assert service.fetcher.bytes_held == 0  # given back after each request, refused or not
    assert registry.get_sample_value("smg_servicer_media_refusals_total", {"reason": "bytes_saturated"}) == 2
    assert registry.get_sample_value("smg_servicer_media_bytes_held_max", {}) == len(PNG) + 5
    # Another request's held bytes count too: a stalled fetch holds its first bytes.
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_fetch, service, origin.url("/slow.png"))
        with trio.fail_after(10):
            while service.fetcher.bytes_held == 0:
                await trio.sleep(0.01)
        with pytest.raises(Unavailable, match="ENGINELINK_MM_MAX_BYTES_IN_FLIGHT"):
            await _fetch(service, data_url)
        nursery.cancel_scope.cancel()
    assert service.fetcher.bytes_held == 0


# -- time and the origin's faults ------------------------------------------------------


async def test_a_stalled_origin_is_unavailable_after_the_fetch_deadline(origin):
    service = _service(allow_private=True, fetch_timeout_s=0.5)
    with pytest.raises(Unavailable, match=r"items\[0\]: the fetch took longer than 0.5 s"):
        await _fetch(service, origin.url("/slow.png"))


async def test_the_origins_faults_are_unavailable_and_the_callers_invalid(origin):
    registry = CollectorRegistry()
    service = _service(allow_private=True, registry=registry)
    with pytest.raises(Unavailable, match=r"items\[1\]: the origin answered 500"):
        await _fetch(service, origin.url("/cat.png"), origin.url("/broken.png"))
    assert "answered 404" in str(await _refused(service, origin.url("/missing.png")))
    assert "not an image" in str(await _refused(service, origin.url("/page.html")))
    error = await _refused(service, origin.url("/page.html"), modality=common_pb2.VIDEO)
    assert "'text/html', not video" in str(error)
    assert "could not connect" in str(await _refused(service, f"http://127.0.0.1:{_closed_port()}/x.png"))
    assert registry.get_sample_value("smg_servicer_media_refusals_total", {"reason": "wrong_media"}) == 2
    assert registry.get_sample_value("smg_servicer_media_fetches_total",
                                     {"scheme": "http", "outcome": "origin_error"}) == 1  # fmt: skip


async def test_a_huge_url_is_refused_and_never_echoed(origin):
    service = _service(origin, names={"cdn.example": [[PUBLIC]]})
    error = await _refused(service, "http://cdn.example/" + "a" * (1 << 20))
    assert "at most 8192" in str(error) and len(str(error)) < 300
    origin.redirect("/to-long", "http://10.0.0.1/" + "b" * 7000)
    error = await _refused(service, f"http://cdn.example:{origin.port}/to-long")
    assert "private" in str(error) and len(str(error)) < 600
    error = await _refused(service, "data:image/png;base64," + "A" * (48 << 20))
    assert "SMG_VLLM_MM_MAX_ITEM_BYTES" in str(error) and len(str(error)) < 300


async def test_an_unresolvable_name_is_the_callers_fault(origin):
    service = _service(origin, names={})
    assert "does not resolve" in str(await _refused(service, "http://no-such-host.example/cat.png"))


async def test_fetched_media_is_not_yet_turned_into_engine_inputs(origin):
    # No model processor on this worker (the sim engine's case): fetched and checked, then FAILED_PRECONDITION.
    service = _service(allow_private=True)
    with pytest.raises(Precondition, match="fetched and checked 1 item"):
        await service.prepare(_refs(origin.url("/cat.png")))
    assert origin.hits == ["/cat.png"]


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("env,words", [
    ({"SMG_VLLM_MM_PROCESSOR": "smg"}, "expected one of inprocess, redis"),
    # The reference's settings enginelink does not act on are validated all the same, as the reference does.
    ({"SMG_VLLM_MM_TURBOJPEG": "always"}, "SMG_VLLM_MM_TURBOJPEG='always': expected one of prefer, require"),
    ({"SMG_VLLM_MM_MAX_VIDEO_FRAMES": "-1"}, "SMG_VLLM_MM_MAX_VIDEO_FRAMES='-1': must be at least 0"),
    ({"SMG_VLLM_MM_REDIS_URL": "http://r:6379"}, "SMG_VLLM_MM_REDIS_URL='http://r:6379': Redis URL must specify"),
    ({"SMG_VLLM_MM_REDIS_URL": "redis://u:secret@r:port/0"},
     r"SMG_VLLM_MM_REDIS_URL='redis://\*\*\*@r:port/0': Port could not be cast"),  # the password masked
    ({"SMG_VLLM_MM_SIDECAR_TIMEOUT_MS": "0"}, "SMG_VLLM_MM_SIDECAR_TIMEOUT_MS='0': must be at least 1"),
    ({"SMG_VLLM_MM_SIDECAR_MAX_QUEUE": "many"}, "SMG_VLLM_MM_SIDECAR_MAX_QUEUE='many': expected a whole number"),
    ({"VLLM_IMAGE_FETCH_TIMEOUT": "2.5"}, "VLLM_IMAGE_FETCH_TIMEOUT='2.5': expected a whole number"),
    ({"SMG_VLLM_MM_MAX_INFLIGHT": "0"}, "must be at least 1"),
    ({"SMG_VLLM_MM_MAX_ITEM_BYTES": "32MiB"}, "expected a whole number"),
    ({"SMG_MM_ALLOW_PRIVATE_MEDIA_HOSTS": "yes please"}, "expected 1 or 0"),
    ({"ENGINELINK_ALLOWED_LOCAL_MEDIA_PATH": "relative/dir"}, "must be an absolute path"),
    ({"ENGINELINK_ALLOWED_MEDIA_DOMAINS": "https://example.com"}, "not a host name"),
    ({"ENGINELINK_ALLOWED_MEDIA_DOMAINS": "example.com:443"}, "not a host name"),
])  # fmt: skip
def test_bad_media_knobs_are_refused_at_start(env, words):
    from enginelink.runtime.contracts.shared.media import MediaKnobError

    with pytest.raises(MediaKnobError, match=words):
        media_settings_from(env)


def test_media_knobs_defaults_and_values():
    assert media_settings_from({}) == MediaSettings()
    settings = media_settings_from({"SMG_VLLM_MM_PROCESSOR": "inprocess", "SMG_MM_ALLOW_PRIVATE_MEDIA_HOSTS": "1",
                                    "SMG_VLLM_MM_FETCH_TIMEOUT_MS": "2500", "ENGINELINK_MM_MAX_REDIRECTS": "0"})
    assert (settings.enabled, settings.allow_private, settings.fetch_timeout_s, settings.redirects_max) == (
        True, True, 2.5, 0)
    assert MediaSettings().item_bytes_max == 32 << 20 and MediaSettings().inflight_max == 64
    # The item cap is unset by default (the engine's limits alone) and the frame cap off (vLLM's sampling).
    assert (MediaSettings().items_max, MediaSettings().video_frames_max) == (None, 0)
    video = media_settings_from({"SMG_VLLM_MM_MAX_VIDEO_FRAMES": "4", "SMG_VLLM_MM_MAX_ITEMS": "3",
                                 "SMG_VLLM_MM_VIDEO_FETCH_TIMEOUT_MS": "45000"})
    assert (video.video_frames_max, video.items_max, video.video_fetch_timeout_s) == (4, 3, 45.0)
    with pytest.raises(MediaKnobError, match="SMG_VLLM_MM_MAX_VIDEO_FRAMES='-1': must be at least 0"):
        media_settings_from({"SMG_VLLM_MM_MAX_VIDEO_FRAMES": "-1"})


def test_vllms_fetch_timeouts_are_honoured_where_the_reference_honours_them():
    # Under inprocess (and in the sidecar), the reference fetches with vLLM's own connector, whose deadlines are
    # VLLM_<MODALITY>_FETCH_TIMEOUT; enginelink's own SMG_VLLM_MM_*FETCH_TIMEOUT_MS, where set, stays first.
    settings = media_settings_from({"VLLM_IMAGE_FETCH_TIMEOUT": "1", "VLLM_VIDEO_FETCH_TIMEOUT": "7",
                                    "VLLM_AUDIO_FETCH_TIMEOUT": "3"})
    assert settings.fetch_deadline("image") == (1.0, "VLLM_IMAGE_FETCH_TIMEOUT")
    assert settings.fetch_deadline("video") == (7.0, "VLLM_VIDEO_FETCH_TIMEOUT")
    assert settings.fetch_deadline("audio") == (3.0, "VLLM_AUDIO_FETCH_TIMEOUT")
    settings = media_settings_from({"VLLM_IMAGE_FETCH_TIMEOUT": "1", "SMG_VLLM_MM_FETCH_TIMEOUT_MS": "2500"})
    assert settings.fetch_deadline("image") == (2.5, "SMG_VLLM_MM_FETCH_TIMEOUT_MS")
    assert settings.fetch_deadline("video") == (30.0, "SMG_VLLM_MM_VIDEO_FETCH_TIMEOUT_MS")  # unset: the default


async def test_a_stalled_origin_is_cut_at_vllms_image_fetch_timeout_naming_it(origin):
    settings = media_settings_from({"SMG_VLLM_MM_PROCESSOR": "inprocess", "SMG_MM_ALLOW_PRIVATE_MEDIA_HOSTS": "1",
                                    "VLLM_IMAGE_FETCH_TIMEOUT": "1"})  # fmt: skip
    service = MediaService(settings)
    started = trio.current_time()
    with pytest.raises(Unavailable, match=r"longer than 1 s \(VLLM_IMAGE_FETCH_TIMEOUT\)"):
        await service.prepare(_refs(origin.url("/slow.png")))
    assert 1.0 <= trio.current_time() - started < 3.0


def test_every_media_bound_is_a_metric_and_in_the_run_record():
    from enginelink.runtime.contracts.shared.media import media_record

    settings = media_settings_from({"SMG_VLLM_MM_PROCESSOR": "redis", "SMG_VLLM_MM_SIDECAR_TIMEOUT_MS": "1500",
                                    "SMG_VLLM_MM_SIDECAR_MAX_QUEUE": "7", "SMG_VLLM_MM_MAX_ITEMS": "3",
                                    "VLLM_VIDEO_FETCH_TIMEOUT": "9", "SMG_VLLM_MM_MAX_VIDEO_FRAMES": "4"})
    registry = CollectorRegistry()
    MediaService(settings, registry=registry, sidecar_fingerprint=None)
    sample = registry.get_sample_value
    assert (sample("smg_servicer_media_sidecar_timeout_seconds"), sample("smg_servicer_media_sidecar_queue_max"),
            sample("smg_servicer_media_items_max"), sample("smg_servicer_media_video_fetch_timeout_seconds"),
            sample("smg_servicer_media_image_fetch_timeout_seconds"), sample("smg_servicer_media_item_bytes_max"),
            sample("smg_servicer_media_video_frames_max")) == (1.5, 7, 3, 9, 10, 32 << 20, 4)
    assert sample("smg_servicer_media_sidecar_advertised") == 0  # not yet probed
    record = media_record(settings, "flag")
    assert (record["mm_processor"], record["mm_processor_source"]) == ("redis", "flag")
    assert record["bounds"]["SMG_VLLM_MM_SIDECAR_MAX_QUEUE"] == 7
    assert record["bounds"]["VLLM_VIDEO_FETCH_TIMEOUT"] == 9.0
    assert record["bounds"]["SMG_VLLM_MM_MAX_INFLIGHT"] == 64
    assert media_record(media_settings_from({}))["mm_processor_source"] == "default"


def test_the_processor_helpers_bounds_are_knobs_shown_in_metrics():
    settings = media_settings_from({"SMG_VLLM_MM_PROCESSOR": "inprocess", "ENGINELINK_MM_PROCESSOR_START_TIMEOUT_S": "90",
                                    "ENGINELINK_MM_PROCESS_TIMEOUT_S": "15"})
    registry = CollectorRegistry()
    MediaService(settings, registry=registry)
    assert registry.get_sample_value("smg_servicer_media_processor_start_timeout_seconds", {}) == 90
    assert registry.get_sample_value("smg_servicer_media_process_timeout_seconds", {}) == 15
    defaults = CollectorRegistry()
    MediaService(media_settings_from({"SMG_VLLM_MM_PROCESSOR": "inprocess"}), registry=defaults)
    assert defaults.get_sample_value("smg_servicer_media_processor_start_timeout_seconds", {}) == 180
    assert defaults.get_sample_value("smg_servicer_media_process_timeout_seconds", {}) == 60
