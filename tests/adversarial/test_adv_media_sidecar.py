"""``--mm-processor redis`` against a real redis-server: the worker's side, and enginelink's sidecar.

Each test starts its own private Redis (``tests/redis_server.py``: a unix
socket in a 0700 folder, a password, no TCP port) and attacks one property:

- the worker advertises ``mm_processor=redis`` only while a hello with its
  own fingerprint lives, and says why not;
- a job carries the fingerprint, the prompt, the refs and its deadline; the
  result's code says whose fault a failure is (``media_too_large`` the
  client's), an answer the worker cannot read is retryable;
- nothing waits forever: no sidecar (the timeout), a deep queue (at once),
  Redis killed mid-job (at once), Redis silent (the bound); the worker
  recovers when Redis returns;
- enginelink's sidecar (in process, over a scripted processor helper that
  speaks the real helper's frames): a job through it, its hello, the
  result's expiry, a refused domain, an expired job, a result over the cap
  (``result_too_large``), a result Redis refuses (``result_push_failed``, at
  once), and a Redis restart under it.

The real helper and the reference's sidecar and worker are
``tests/vllm/test_vllm_media_sidecar.py``.
"""

from __future__ import annotations

import base64
import sys
import textwrap

import msgspec
import pytest
import trio
import trio_asyncio
from grpclib.const import Status
from prometheus_client import CollectorRegistry
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2 as pb

from enginelink.runtime.errors import ClientError, Unavailable
from enginelink.runtime.contracts.shared.media import MediaMetrics, MediaService, media_settings_from
from enginelink.runtime.requests.media_bounds import MediaBounds
from enginelink.runtime.requests.media_fetch import Fetcher
from enginelink.runtime.requests.media_processor import MediaProcessor
from enginelink.runtime.requests.media_redis import RedisLink
from enginelink.runtime.requests.media_sidecar import Sidecar
from enginelink.wire import mm_sidecar as wire
from tests.adversarial.media_origin import PNG, Origin
from tests.redis_server import RedisServer

pytestmark = pytest.mark.process  # a redis-server per test

FP = wire.Fingerprint(model="/models/vision", vllm_version="0.32.0", dtype="torch.bfloat16", video_backend="opencv",
                      media_io_kwargs="{}", mm_processor_kwargs="{}", limit_per_prompt='{"*": {"count": 999}}')
KEYS = wire.Keys.of(FP)
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
ITEM = {"pixel_values": {"data": ["float32", [2], msgspec.msgpack.Ext(3, b"\x00" * 8)],
                         "field": ["batched", {"keep_on_cpu": False}]}}  # fmt: skip


@pytest.fixture
def redis(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


def _worker(redis: RedisServer, registry=None, **env: str) -> MediaService:
    environ = {"SMG_VLLM_MM_PROCESSOR": "redis", "SMG_VLLM_MM_REDIS_URL": redis.url,
               "SMG_VLLM_MM_SIDECAR_TIMEOUT_MS": "5000", **env}  # fmt: skip
    return MediaService(media_settings_from(environ), sidecar_fingerprint=FP, registry=registry)


def _hello(redis: RedisServer, fingerprint: wire.Fingerprint = FP, schemes: str = "http,https,data",
           key: str = KEYS.hello) -> None:  # fmt: skip
    redis.client().hset(key, mapping={**fingerprint.fields(), "schema": "1", "schemes": schemes})


def _refs(*urls: str) -> pb.MediaRefs:
    return pb.MediaRefs(items=[pb.MediaRef(modality=common_pb2.IMAGE, url=url) for url in urls])


def _ok(job: wire.Job, **change) -> wire.JobResult:
    fields = dict(v=1, job_id=job.job_id, ok=True, fingerprint=FP, prompt_token_ids=[7, 7] + job.prompt_token_ids,
                  mm_hashes={"image": ["h0"]}, mm_placeholders={"image": [wire.Placeholder(0, 2)]},
                  mm_kwargs={"image": [msgspec.msgpack.encode(ITEM)]})  # fmt: skip
    fields.update(change)
    return wire.JobResult(**fields)


async def _sidecar_once(redis: RedisServer, answer, keys: wire.Keys = KEYS) -> wire.Job:
    """A scripted sidecar: one job off the queue, ``answer(job)`` (a result, or raw bytes) pushed back."""
    link = RedisLink(redis.url, connections_max=4)
    try:
        _, raw = await link.call(10, "brpop", [keys.jobs], timeout=8)
        job = wire.decode_job(raw)
        reply = answer(job)
        await link.call(2, "lpush", keys.result(job.job_id), reply if isinstance(reply, bytes) else wire.encode(reply))
        return job
    finally:
        await link.aclose()


# -- the worker: advertising -----------------------------------------------------------


async def test_the_worker_advertises_only_while_a_hello_with_its_fingerprint_lives(redis):
    async with trio_asyncio.open_loop():
        registry = CollectorRegistry()
        service = _worker(redis, registry=registry)
        try:
            assert not await service.sidecar.probe() and service.server_fields() == {}
            assert "no sidecar hello" in service.sidecar.why_not
            other = msgspec.structs.replace(FP, dtype="torch.float32")
            _hello(redis, other)  # another worker's sidecar, forced onto this key: not this worker's
            assert not await service.sidecar.probe()
            assert "differs on dtype" in service.sidecar.why_not
            _hello(redis, schemes="http,https,data,file")
            assert await service.sidecar.probe()
            assert service.server_fields() == {"mm_processor": "redis", "mm_media_ref_schemes": "http,https,data,file",
                                               "mm_processor_source": "env"}  # fmt: skip
            assert registry.get_sample_value("smg_servicer_media_sidecar_advertised") == 1
            redis.client().delete(KEYS.hello)  # every sidecar gone: the hello lapses
            assert not await service.sidecar.probe() and service.server_fields() == {}
            assert registry.get_sample_value("smg_servicer_media_sidecar_advertised") == 0
        finally:
            await service.aclose()


async def test_the_namespace_is_the_fingerprints_unless_the_operator_names_one(redis):
    assert KEYS.prefix == f"smg:mm:v1:{FP.namespace()}" and len(FP.namespace()) == 16
    assert wire.Keys.of(msgspec.structs.replace(FP, limit_per_prompt='{"*": {"count": 2}}')).prefix != KEYS.prefix
    async with trio_asyncio.open_loop():
        service = _worker(redis, SMG_VLLM_MM_SIDECAR_NAMESPACE="fleet-a")
        try:
            _hello(redis, key="smg:mm:v1:fleet-a:hello")
            assert await service.sidecar.probe()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_sidecar_once, redis, _ok, wire.Keys("smg:mm:v1:fleet-a"))
                await service.prepare(_refs(DATA_URL), [5])
        finally:
            await service.aclose()


# -- the worker: one job -------------------------------------------------------------------


async def test_a_job_carries_what_the_sidecar_needs_and_the_result_becomes_mm_features(redis):
    async with trio_asyncio.open_loop():
        service = _worker(redis)
        try:
            _hello(redis)
            await service.sidecar.probe()
            jobs = []
            async with trio.open_nursery() as nursery:
                async def sidecar():
                    jobs.append(await _sidecar_once(redis, lambda job: _ok(job, mm_placeholders={
                        "image": [wire.Placeholder(0, 2, [False, True])]})))

                nursery.start_soon(sidecar)
                prompt, features, *_ = await service.prepare(_refs(DATA_URL, "https://example.com/a.png"), [5, 6])
            job = jobs[0]
            assert job.v == 1 and job.fingerprint == FP and job.prompt_token_ids == [5, 6]
            assert [(item.modality, item.url) for item in job.items] == [("image", DATA_URL),
                                                                        ("image", "https://example.com/a.png")]
            assert job.deadline_ms - job.enqueued_ms == 5000  # the worker's timeout travels as the job's deadline
            assert prompt == [7, 7, 5, 6]
            assert features == [{"data": ITEM, "modality": "image", "identifier": "h0", "mm_hash": "h0",
                                 "mm_position": {"offset": 0, "length": 2,
                                                 "is_embed": ["bool", [2], msgspec.msgpack.Ext(3, b"\x00\x01")]}}]
            assert redis.client().llen(KEYS.jobs) == 0
        finally:
            await service.aclose()


async def test_video_and_audio_refs_ride_the_sidecar_held_to_the_engines_limits_and_encoder_budget(redis):
    """A video and an audio ref go to the sidecar as they came; the result's feature tokens (its placeholder
    ranges, the embed mask counted) are held to the engine's encoder budget as the worker's own helper's are,
    and a count past the engine's limit is refused before anything is queued."""
    video, audio = "data:video/mp4;base64,AAAA", "data:audio/wav;base64,AAAA"
    refs = pb.MediaRefs(items=[pb.MediaRef(modality=common_pb2.VIDEO, url=video),
                               pb.MediaRef(modality=common_pb2.AUDIO, url=audio)])  # fmt: skip
    bounds = MediaBounds(engine_limits={"image": 0, "video": 1, "audio": 1}, encoder_budget=3)
    blob = msgspec.msgpack.encode(ITEM)

    def answer(video_length: int):
        return lambda job: _ok(job, prompt_token_ids=[7] * 6 + job.prompt_token_ids,
                               mm_hashes={"video": ["v0"], "audio": ["a0"]}, mm_kwargs={"video": [blob], "audio": [blob]},
                               mm_placeholders={"video": [wire.Placeholder(0, video_length)],
                                                "audio": [wire.Placeholder(2, 4, [True, True, False, True])]})

    async with trio_asyncio.open_loop():
        service = _worker(redis)
        try:
            _hello(redis)
            await service.sidecar.probe()
            jobs = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: _grab(jobs, _sidecar_once(redis, answer(2))))
                processed = await service.prepare(refs, [5], bounds)
            assert [(item.modality, item.url) for item in jobs[0].items] == [("video", video), ("audio", audio)]
            assert processed.prompt == [7] * 6 + [5]
            assert [(f["modality"], f["mm_hash"]) for f in processed.features] == [("video", "v0"), ("audio", "a0")]
            assert processed.embeds == [("video", 0, 2), ("audio", 0, 3)] and processed.identity is None
            # A video whose features the engine's encoder cannot place: the client's, naming the item.
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: _grab(jobs, _sidecar_once(redis, answer(4))))
                with pytest.raises(ClientError) as refused:
                    await service.prepare(refs, [5], bounds)
            assert str(refused.value) == ("media_refs.items[0]: the video item has 4 feature tokens, above the "
                                          "engine's encoder budget of 3 tokens (mm_encoder_budget); send a smaller "
                                          "item")
            # Two videos: past the engine's limit, refused before a job is queued.
            with pytest.raises(ClientError, match=r"2 video item\(s\); at most 1 per request \(the engine's limit"):
                await service.prepare(pb.MediaRefs(items=[refs.items[0], refs.items[0]]), [5], bounds)
            assert redis.client().llen(KEYS.jobs) == 0 and len(jobs) == 2
        finally:
            await service.aclose()


async def _grab(into: list, job) -> None:
    into.append(await job)


@pytest.mark.parametrize("answer, status, words", [
    (lambda job: wire.failure(job.job_id, "fetch_failed", "item 0: 404"), Status.INVALID_ARGUMENT, "fetch_failed"),
    (lambda job: wire.failure(job.job_id, "domain_not_allowed", "x"), Status.INVALID_ARGUMENT, "domain_not_allowed"),
    (lambda job: wire.failure(job.job_id, "result_too_large", "9 bytes"), Status.INVALID_ARGUMENT, "media_too_large"),
    (lambda job: wire.failure(job.job_id, "result_push_failed", "refused"), Status.UNAVAILABLE, "result_push_failed"),
    (lambda job: wire.failure(job.job_id, "processor_error", "boom"), Status.UNAVAILABLE, "processor_error"),
    (lambda job: wire.failure(job.job_id, "expired", "late"), Status.UNAVAILABLE, "expired"),
    (lambda job: b"\xc1 not msgpack", Status.UNAVAILABLE, "undecodable result"),
    (lambda job: _ok(job, job_id="another"), Status.UNAVAILABLE, "on the key of"),
    (lambda job: _ok(job, fingerprint=msgspec.structs.replace(FP, model="other")), Status.UNAVAILABLE,
     "fingerprint_mismatch"),
    (lambda job: _ok(job, mm_hashes={"image": []}), Status.UNAVAILABLE, "1 items, 1 placeholder ranges and 0 hashes"),
    (lambda job: _ok(job, mm_placeholders={"image": [wire.Placeholder(5, 9)]}), Status.UNAVAILABLE,
     "outside the 3-token prompt"),
])  # fmt: skip
async def test_a_failed_or_unreadable_result_says_whose_fault(redis, answer, status, words):
    async with trio_asyncio.open_loop():
        service = _worker(redis)
        try:
            _hello(redis)
            await service.sidecar.probe()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_sidecar_once, redis, answer)
                with pytest.raises((ClientError, Unavailable)) as caught:
                    await service.prepare(_refs(DATA_URL), [5])
            assert caught.value.status == status and words in str(caught.value), caught.value
        finally:
            await service.aclose()


async def test_refs_the_sidecar_would_refuse_are_refused_before_queueing(redis):
    async with trio_asyncio.open_loop():
        service = _worker(redis, SMG_VLLM_MM_MAX_ITEM_BYTES="10")
        try:
            _hello(redis)
            await service.sidecar.probe()
            with pytest.raises(ClientError, match=r"items\[0\].*scheme 'file'.*accepted: data,http,https"):
                await service.prepare(_refs("file:///etc/passwd"), [5])
            with pytest.raises(ClientError, match=r"items\[0\].*at most 10 \(SMG_VLLM_MM_MAX_ITEM_BYTES\)"):
                await service.prepare(_refs(DATA_URL), [5])
            assert redis.client().llen(KEYS.jobs) == 0
        finally:
            await service.aclose()


# -- the worker: nothing waits forever -------------------------------------------------------


async def test_with_no_sidecar_the_wait_ends_unavailable_at_the_timeout(redis):
    async with trio_asyncio.open_loop():
        service = _worker(redis, SMG_VLLM_MM_SIDECAR_TIMEOUT_MS="600")
        try:
            _hello(redis)
            await service.sidecar.probe()
            started = trio.current_time()
            with pytest.raises(Unavailable, match="sidecar_timeout: no result .* SMG_VLLM_MM_SIDECAR_TIMEOUT_MS=600"):
                await service.prepare(_refs(DATA_URL), [5])
            assert 0.55 <= trio.current_time() - started < 2.0
            assert service.jobs == 0
        finally:
            await service.aclose()


async def test_a_deep_queue_is_refused_at_once_and_nothing_more_is_queued(redis):
    async with trio_asyncio.open_loop():
        service = _worker(redis, SMG_VLLM_MM_SIDECAR_MAX_QUEUE="2")
        try:
            _hello(redis)
            await service.sidecar.probe()
            redis.client().lpush(KEYS.jobs, b"a", b"b")
            started = trio.current_time()
            with pytest.raises(Unavailable, match="sidecar_overloaded: 2 jobs queued, at "
                                                  "SMG_VLLM_MM_SIDECAR_MAX_QUEUE=2") as caught:
                await service.prepare(_refs(DATA_URL), [5])
            assert caught.value.reason == "sidecar_overloaded"
            assert trio.current_time() - started < 1.0
            assert redis.client().llen(KEYS.jobs) == 2
        finally:
            await service.aclose()


async def test_redis_killed_mid_job_is_unavailable_at_once_and_the_worker_recovers(redis):
    async with trio_asyncio.open_loop():
        service = _worker(redis, SMG_VLLM_MM_SIDECAR_TIMEOUT_MS="30000")
        try:
            _hello(redis)
            assert await service.sidecar.probe()
            outcome = []

            async def request():
                started = trio.current_time()
                try:
                    await service.prepare(_refs(DATA_URL), [5])
                except Unavailable as error:
                    outcome.append((error, trio.current_time() - started))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(request)
                with trio.fail_after(10):
                    while redis.client().llen(KEYS.jobs) == 0:  # the job is queued: the worker waits on Redis
                        await trio.sleep(0.02)
                redis.kill()
            (error, waited), = outcome
            assert "sidecar_unavailable" in str(error) and waited < 3.0, (error, waited)  # not the 30 s timeout
            assert service.jobs == 0
            started = trio.current_time()
            assert not await service.sidecar.probe() and service.server_fields() == {}
            assert "Redis unreachable" in service.sidecar.why_not and trio.current_time() - started < 2.0
            with pytest.raises(Unavailable, match="sidecar_unavailable"):
                await service.prepare(_refs(DATA_URL), [5])

            redis.start()  # Redis returns (empty: a restarted Redis keeps nothing here), and a sidecar with it
            _hello(redis)
            assert await service.sidecar.probe()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_sidecar_once, redis, _ok)
                prompt, features, *_ = await service.prepare(_refs(DATA_URL), [5])
            assert prompt == [7, 7, 5] and features[0]["mm_hash"] == "h0"
        finally:
            await service.aclose()


async def test_a_silent_redis_ends_each_wait_at_its_bound(redis):
    async with trio_asyncio.open_loop():
        service = _worker(redis, SMG_VLLM_MM_SIDECAR_TIMEOUT_MS="1000")
        try:
            _hello(redis)
            assert await service.sidecar.probe()
            redis.pause()  # the socket stays open; nothing answers
            try:
                started = trio.current_time()
                assert not await service.sidecar.probe()
                assert trio.current_time() - started < 2.0
                started = trio.current_time()
                with pytest.raises(Unavailable, match="sidecar_unavailable: .*no answer to LLEN within 1 s"):
                    await service.prepare(_refs(DATA_URL), [5])
                assert trio.current_time() - started < 2.0
            finally:
                redis.resume()
            assert await service.sidecar.probe()
        finally:
            await service.aclose()


# -- enginelink's sidecar -----------------------------------------------------------------


async def _popped(redis: RedisServer, key: str, timeout_s: float = 10.0) -> bytes:
    """The next value on ``key``, looked for without blocking trio (the sidecar under test runs in it)."""
    with trio.fail_after(timeout_s):
        while (raw := redis.client().rpop(key)) is None:
            await trio.sleep(0.02)
    return raw

CHILD = textwrap.dedent(r'''
    import json, os, struct, sys, time, msgspec
    H = struct.Struct(">I")
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    def send(obj):
        body = msgspec.msgpack.encode(obj)
        out.write(H.pack(len(body)) + body); out.flush()
    fp = json.loads(os.environ["FAKE_FINGERPRINT"])
    fp["engine_args"] = os.environ.get("ENGINELINK_MM_ENGINE_ARGS", "")
    send({"ready": True, "version": "fake", "fingerprint": fp})
    while True:
        head = inp.read(4)
        if len(head) < 4:
            sys.exit(0)
        req = msgspec.msgpack.decode(inp.read(H.unpack(head)[0]))
        cue = req["prompt"][0]
        if cue == 3:
            time.sleep(3600)
        if cue == 4:
            send({"id": req["id"], "error": "not a decodable image: broken", "fault": "client", "item": 0})
            continue
        size = (2 << 20) if cue == 5 else 8
        features = [{"data": {"pixel_values": {"data": ["float32", [size // 4], msgspec.msgpack.Ext(3, b"\0" * size)],
                                               "field": ["batched", {"keep_on_cpu": False}]}},
                     "modality": item["modality"], "identifier": "h%d" % i, "mm_hash": "h%d" % i,
                     "mm_position": {"offset": 2 * i, "length": 2, "is_embed": None}}
                    for i, item in enumerate(req["items"])]
        send({"id": req["id"], "prompt": [9] * (2 * len(req["items"])) + req["prompt"], "features": features})
''')


@pytest.fixture
def origin():
    with Origin() as running:
        yield running


async def _start_sidecar(nursery, redis: RedisServer, tmp_path, monkeypatch, *, result_bytes_max=512 << 20,
                         fingerprint: wire.Fingerprint = FP, **env: str) -> Sidecar:  # fmt: skip
    script = tmp_path / "fake_child.py"
    script.write_text(CHILD)
    monkeypatch.setenv("FAKE_FINGERPRINT", msgspec.json.encode(fingerprint.fields()).decode())
    settings = media_settings_from({"SMG_VLLM_MM_REDIS_URL": redis.url, "SMG_MM_ALLOW_PRIVATE_MEDIA_HOSTS": "1",
                                    **env})  # fmt: skip
    metrics = MediaMetrics(CollectorRegistry(), {}, settings.inflight_max, settings.bytes_in_flight_max)
    processor = MediaProcessor("/m", lambda: sys.executable, start_timeout_s=30, process_timeout_s=30,
                               reply_bytes_max=64 << 20, script=script, engine_args=[])  # fmt: skip
    sidecar = Sidecar(RedisLink(redis.url, connections_max=8), Fetcher(settings, metrics), processor,
                      settings=settings, namespace=None, concurrency=2, result_bytes_max=result_bytes_max)

    async def run():
        try:
            await sidecar.run()
        finally:
            with trio.CancelScope(shield=True):
                await processor.aclose()
                await sidecar.link.aclose()

    nursery.start_soon(run)
    with trio.fail_after(30):
        while not redis.client().exists(KEYS.hello):
            await trio.sleep(0.02)
    return sidecar


async def test_enginelinks_sidecar_serves_a_job_with_the_processors_tensors(redis, origin, tmp_path, monkeypatch):
    async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
        sidecar = await _start_sidecar(nursery, redis, tmp_path, monkeypatch)
        hello = {k.decode(): v.decode() for k, v in redis.client().hgetall(KEYS.hello).items()}
        assert {k: hello[k] for k in FP.fields()} == {**FP.fields()} and hello["schema"] == "1"
        assert hello["schemes"] == "http,https,data" and hello["implementation"] == "enginelink"
        assert 0 < redis.client().ttl(KEYS.hello) <= wire.HELLO_TTL_S
        service = _worker(redis)
        try:
            assert await service.sidecar.probe()
            prompt, features, *_ = await service.prepare(_refs(DATA_URL, origin.url("/cat.png")), [1, 6])
            assert prompt == [9, 9, 9, 9, 1, 6]
            assert [f["mm_hash"] for f in features] == ["h0", "h1"]
            assert features[1]["data"]["pixel_values"]["data"] == ["float32", [2],
                                                                   msgspec.msgpack.Ext(3, b"\0" * 8)]
            assert origin.hits == ["/cat.png"]
            # An answer no worker collects expires after RESULT_TTL_S.
            job = wire.Job(v=1, job_id="left", request_id="", fingerprint=FP, prompt_token_ids=[5], prompt=None,
                           items=[wire.JobItem("image", DATA_URL)], enqueued_ms=0, deadline_ms=2**62)
            redis.client().lpush(KEYS.jobs, wire.encode(job))
            with trio.fail_after(10):
                while not redis.client().exists(KEYS.result("left")):
                    await trio.sleep(0.02)
            assert 0 < redis.client().ttl(KEYS.result("left")) <= wire.RESULT_TTL_S
            with trio.fail_after(5):
                while sidecar.done < 2:  # counted once its push is done
                    await trio.sleep(0.01)
        finally:
            await service.aclose()
            nursery.cancel_scope.cancel()


async def test_the_sidecar_answers_whose_fault_without_work_where_it_can(redis, origin, tmp_path, monkeypatch):
    async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
        await _start_sidecar(nursery, redis, tmp_path, monkeypatch, ENGINELINK_ALLOWED_MEDIA_DOMAINS="example.com")
        service = _worker(redis)
        try:
            await service.sidecar.probe()
            with pytest.raises(ClientError, match=r"domain_not_allowed.*items\[0\].*allowed media domains"):
                await service.prepare(_refs(origin.url("/cat.png")), [5])
            with pytest.raises(ClientError, match=r"decode_failed.*not a decodable image"):
                await service.prepare(_refs(DATA_URL), [4])
            assert origin.hits == []
            # A job whose deadline has passed is answered "expired", fetched and processed never.
            job = wire.Job(v=1, job_id="late", request_id="", fingerprint=FP, prompt_token_ids=[5], prompt=None,
                           items=[wire.JobItem("image", "https://example.com/cat.png")], enqueued_ms=0, deadline_ms=1)
            redis.client().lpush(KEYS.jobs, wire.encode(job))
            raw = await _popped(redis, KEYS.result("late"))
            assert (wire.decode_result(raw).code, wire.decode_result(raw).ok) == ("expired", False)
        finally:
            await service.aclose()
            nursery.cancel_scope.cancel()


async def test_a_result_over_the_cap_is_media_too_large_and_one_redis_refuses_is_reported_at_once(
        redis, tmp_path, monkeypatch):  # fmt: skip
    async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
        await _start_sidecar(nursery, redis, tmp_path, monkeypatch, result_bytes_max=1000)
        service = _worker(redis, SMG_VLLM_MM_SIDECAR_TIMEOUT_MS="20000")
        try:
            await service.sidecar.probe()
            with pytest.raises(ClientError, match=r"media_too_large: the encoded media result is \d+ bytes, over the "
                                                  r"transport limit of 1000 bytes \(SMG_VLLM_MM_MAX_RESULT_BYTES"):
                await service.prepare(_refs(DATA_URL), [5])
        finally:
            await service.aclose()
            nursery.cancel_scope.cancel()
    redis.stop()
    redis.start()
    async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
        await _start_sidecar(nursery, redis, tmp_path, monkeypatch)  # learns Redis's own cap, 512 MiB, at start
        redis.client().config_set("proto-max-bulk-len", 1 << 20)  # then Redis takes 1 MiB values at most
        service = _worker(redis, SMG_VLLM_MM_SIDECAR_TIMEOUT_MS="20000")
        try:
            await service.sidecar.probe()
            started = trio.current_time()
            with pytest.raises(Unavailable, match="result_push_failed: the sidecar's result push failed"):
                await service.prepare(_refs(DATA_URL), [5])  # cue 5: a 2 MiB tensor
            assert trio.current_time() - started < 10.0  # reported, not left to the 20 s timeout
            prompt, *_ = await service.prepare(_refs(DATA_URL), [6])  # and the sidecar serves on
            assert prompt == [9, 9, 6]
        finally:
            await service.aclose()
            nursery.cancel_scope.cancel()


async def test_the_sidecar_rides_out_a_redis_restart(redis, tmp_path, monkeypatch):
    async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
        sidecar = await _start_sidecar(nursery, redis, tmp_path, monkeypatch)
        redis.kill()
        await trio.sleep(1.5)  # its job loops and hello meet a dead Redis, and wait to retry
        redis.start()
        service = _worker(redis)
        try:
            with trio.fail_after(wire.HELLO_REFRESH_S + 5):
                while not await service.sidecar.probe():  # the hello comes back with the next refresh
                    await trio.sleep(0.2)
            prompt, *_ = await service.prepare(_refs(DATA_URL), [6])
            assert prompt == [9, 9, 6]
            with trio.fail_after(5):  # the sidecar counts a job once its push returns, a moment after the worker has it
                while sidecar.done != 1:
                    await trio.sleep(0.01)
        finally:
            await service.aclose()
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("argv, env, words", [
    (["--redis-url", "http://r:6379"], {}, "--redis-url (SMG_VLLM_MM_REDIS_URL)='http://r:6379': Redis URL must "
     "specify one of the following schemes"),
    ([], {"SMG_VLLM_MM_MAX_RESULT_BYTES": "512MiB"}, "SMG_VLLM_MM_MAX_RESULT_BYTES='512MiB': expected a whole number"),
    ([], {"SMG_VLLM_MM_MAX_ITEM_BYTES": "0"}, "SMG_VLLM_MM_MAX_ITEM_BYTES='0': must be at least 1"),
    (["--concurrency", "0"], {}, "--concurrency 0: must be at least 1"),
    ([], {"SMG_VLLM_MM_MAX_VIDEO_FRAMES": "-1"}, "SMG_VLLM_MM_MAX_VIDEO_FRAMES='-1': must be at least 0"),
])  # fmt: skip
def test_the_sidecar_command_refuses_a_bad_setting_with_exit_2_naming_it(argv, env, words, tmp_path):
    import os
    import subprocess

    from tests.harness import VENV_BIN

    done = subprocess.run([str(VENV_BIN / "enginelink"), "media-sidecar", "--model", str(tmp_path), *argv],
                          capture_output=True, text=True, timeout=60, env={**os.environ, **env})  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"enginelink media-sidecar: {words}" or words in done.stderr, done.stderr


def test_the_sidecar_command_hands_its_frame_cap_and_engine_args_to_the_processor(redis, tmp_path):
    """``enginelink media-sidecar`` with ``SMG_VLLM_MM_MAX_VIDEO_FRAMES`` and the worker's ``--media-io-kwargs``
    after ``--``: its processor helper is started with the frame cap and those engine arguments (what vLLM's
    loaders are built from), and the sidecar serves (its hello lives) until SIGTERM, exit 0. The helper here is
    the scripted one, started through a stand-in vLLM interpreter that records what it was given."""
    import json
    import os
    import signal
    import subprocess

    from tests.harness import VENV_BIN, wait_until

    child = tmp_path / "fake_child.py"
    child.write_text(CHILD)
    seen = tmp_path / "started.json"
    python = tmp_path / "python"
    python.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""\
        import json, os, sys
        with open({str(seen)!r}, "w") as out:
            json.dump({{"argv": sys.argv[1:], "engine_args": os.environ.get("ENGINELINK_MM_ENGINE_ARGS")}}, out)
        os.execv({sys.executable!r}, [{sys.executable!r}, {str(child)!r}, *sys.argv[2:]])
    """))
    python.chmod(0o755)
    io_kwargs = '{"video": {"num_frames": 4}}'
    env = {**os.environ, "ENGINELINK_VLLM_PYTHON": str(python), "SMG_VLLM_MM_MAX_VIDEO_FRAMES": "3",
           "FAKE_FINGERPRINT": msgspec.json.encode(FP.fields()).decode()}
    sidecar = subprocess.Popen([str(VENV_BIN / "enginelink"), "media-sidecar", "--model", str(tmp_path),
                                "--redis-url", redis.url, "--", "--media-io-kwargs", io_kwargs],
                               env=env, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        try:
            wait_until(lambda: any(key.endswith(b":hello") for key in redis.client().keys("*")), 120,
                       "the sidecar's hello in Redis")
        except TimeoutError:
            sidecar.kill()
            raise AssertionError(sidecar.stderr.read()[-3000:]) from None
        started = json.loads(seen.read_text())
        argv = started["argv"]
        assert argv[argv.index("--max-video-frames") + 1] == "3", argv
        assert json.loads(started["engine_args"]) == ["--media-io-kwargs", io_kwargs]
    finally:
        sidecar.send_signal(signal.SIGTERM)
        try:
            status = sidecar.wait(60)
        except subprocess.TimeoutExpired:
            sidecar.kill()
            raise
    assert status == 0, sidecar.stderr.read()[-3000:]
