"""Media refs through ``enginelink serve`` (sim engine) over gRPC: the codes, GetServerInfo and /metrics a user sees.

Two servicers: media refs on with the default policy (loopback is private:
refused), and on with ``SMG_MM_ALLOW_PRIVATE_MEDIA_HOSTS=1`` (fetched from a
loopback origin started here). A third, the shared default servicer, has
them off. What is fetched is then refused FAILED_PRECONDITION: the sim engine
has no model processor (the real one is tests/vllm/test_vllm_vision.py).
"""

from __future__ import annotations

import base64

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2 as pb

from tests.adversarial.conftest import limited_servicer
from tests.adversarial.media_origin import PNG, Origin
from tests.harness import generate_request, scrape, shared

pytestmark = [pytest.mark.process, pytest.mark.slow]


@pytest.fixture(scope="module")
def origin():
    with Origin() as running:
        yield running


@pytest.fixture(scope="module")
def strict(tmp_path_factory, test_model_dir):
    env = {"SMG_VLLM_MM_PROCESSOR": "inprocess", "SMG_VLLM_MM_MAX_ITEMS": "2"}
    with shared(limited_servicer(tmp_path_factory.mktemp("media-strict"), test_model_dir, env)) as running:
        yield running


@pytest.fixture(scope="module")
def allowing(tmp_path_factory, test_model_dir):
    env = {"SMG_VLLM_MM_PROCESSOR": "inprocess", "SMG_MM_ALLOW_PRIVATE_MEDIA_HOSTS": "1",
           "SMG_VLLM_MM_FETCH_TIMEOUT_MS": "1000"}
    with shared(limited_servicer(tmp_path_factory.mktemp("media-allow"), test_model_dir, env)) as running:
        yield running


@pytest.fixture(scope="module")
def domains(tmp_path_factory, test_model_dir):
    """Media on, loopback allowed as an address, and only the host 127.0.0.1 allowed as a domain (the flags)."""
    servicer = limited_servicer(tmp_path_factory.mktemp("media-domains"), test_model_dir,
                                {"SMG_MM_ALLOW_PRIVATE_MEDIA_HOSTS": "1"})
    servicer.argv += ["--mm-processor", "inprocess", "--allowed-media-domains", "127.0.0.1"]
    with shared(servicer) as running:
        yield running


def _request(*urls: str) -> pb.GenerateRequest:
    request = generate_request("media-1", [5, 6, 7], max_tokens=2)
    for url in urls:
        request.media_refs.items.add(modality=common_pb2.IMAGE, url=url)
    return request


def _status(servicer, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        list(servicer.stub.Generate(request, timeout=20))
    return error.value


def test_media_refs_are_refused_where_the_processor_is_off(servicer):
    error = _status(servicer, _request("https://cdn.example/cat.png"))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--mm-processor (SMG_VLLM_MM_PROCESSOR) is off" in error.details()
    info = servicer.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert (info.mm_processor, info.mm_media_ref_schemes) == ("", "")


def test_server_info_advertises_the_processor_and_schemes(strict):
    info = strict.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert (info.mm_processor, info.mm_media_ref_schemes) == ("inprocess", "http,https,data")
    assert info.mm_processor_source == "env"  # which setting decided: SMG_VLLM_MM_PROCESSOR


def test_redis_without_a_model_processor_is_never_advertised_and_says_why(tmp_path, test_model_dir):
    # The sim engine has no vLLM to derive the sidecar's fingerprint from: no sidecar can be matched.
    servicer = limited_servicer(tmp_path, test_model_dir, {})
    servicer.argv += ["--mm-processor", "redis", "--mm-redis-url", "unix:///nonexistent/redis.sock"]
    with shared(servicer) as running:
        info = running.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        assert (info.mm_processor, info.mm_processor_source) == ("", "")
        error = _status(running, _request("https://cdn.example/cat.png"))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "the media sidecar cannot be used yet (this worker's engine has no model processor" in error.details()
        assert "worker-side media processing: redis (source=flag)" in running.log()


def test_loopback_is_refused_by_default_and_counted(strict, origin):
    for url in (origin.url("/cat.png"), origin.url("/cat.png", host="localhost"), "http://[::1]/x.png",
                "http://169.254.169.254/latest/meta-data/"):
        error = _status(strict, _request(url))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert "media_refs.items[0]" in error.details() and "SMG_MM_ALLOW_PRIVATE_MEDIA_HOSTS" in error.details()
    assert origin.hits == []
    samples = scrape(strict.metrics_port)
    assert _sample(samples, "smg_servicer_media_refusals_total", 'reason="loopback"') == 3
    assert _sample(samples, "smg_servicer_media_refusals_total", 'reason="link_local"') == 1


def test_request_shape_refusals(strict, origin):
    error = _status(strict, _request(*["data:image/png;base64,AA=="] * 3))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "SMG_VLLM_MM_MAX_ITEMS" in error.details()
    request = _request("data:image/png;base64,AA==")
    request.mm_inputs.im_token_id = 5
    error = _status(strict, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "cannot be combined" in error.details()
    error = _status(strict, _request("gopher://cdn.example/x"))
    assert "scheme 'gopher' is not accepted" in error.details()


def test_allowed_loopback_is_fetched_and_the_origins_faults_are_unavailable(allowing, origin):
    data_url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    error = _status(allowing, _request(origin.url("/cat.png"), data_url))
    # Fetched and checked; the sim engine has no model processor (FAILED_PRECONDITION, not a silent drop).
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
    assert "fetched and checked 2 item(s)" in error.details()
    assert "/cat.png" in origin.hits
    error = _status(allowing, _request(origin.url("/broken.png")))
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "answered 500" in error.details()
    error = _status(allowing, _request(origin.url("/slow.png")))
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "longer than 1 s" in error.details()
    error = _status(allowing, _request(origin.url("/page.html")))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "not an image" in error.details()
    samples = scrape(allowing.metrics_port)
    assert _sample(samples, "smg_servicer_media_fetches_total", 'outcome="ok"', 'scheme="http"') >= 1
    assert _sample(samples, "smg_servicer_media_fetches_total", 'outcome="ok"', 'scheme="data"') == 1
    assert _sample(samples, "smg_servicer_media_fetches_total", 'outcome="origin_error"') == 2
    assert _sample(samples, "smg_servicer_media_fetch_seconds_count", 'scheme="http"') >= 3
    assert _sample(samples, "smg_servicer_media_jobs_in_flight_max") == 64
    assert allowing.stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy


def test_the_allowed_media_domains_are_enforced_at_every_hop(domains, origin):
    error = _status(domains, _request(origin.url("/cat.png")))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()  # fetched: the domain is allowed
    error = _status(domains, _request(origin.url("/cat.png"), origin.url("/other.png", host="localhost")))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "media_refs.items[1]" in error.details()
    assert "'localhost' is not one of the allowed media domains (127.0.0.1" in error.details()
    origin.redirect("/to-localhost", f"http://localhost:{origin.port}/redirected.png")
    error = _status(domains, _request(origin.url("/to-localhost")))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "media_refs.items[0]" in error.details() and "redirected to" in error.details()
    assert "/other.png" not in origin.hits and "/redirected.png" not in origin.hits
    assert _sample(scrape(domains.metrics_port), "smg_servicer_media_refusals_total", 'reason="domain"') == 2


def _sample(samples: dict[str, float], name: str, *labels: str) -> float:
    """The sum of ``name``'s samples whose labels include every one of ``labels``."""
    return sum(value for key, value in samples.items()
               if key.split("{")[0] == name and all(label in key for label in labels))  # fmt: skip


def test_fifos_and_nul_file_urls_are_refused_at_once_and_the_stop_still_ends_it(tmp_path, test_model_dir):
    """Issue 38, items 3 and 6: a ``file:`` ref to a FIFO under the allowed folder held a worker thread
    past every timeout (about 40 of them stopped all media work, and SIGTERM no longer ended the
    servicer); ``%00`` in a ``file:`` URL was INTERNAL, logged as our bug."""
    import concurrent.futures
    import os
    import signal
    import time

    folder = tmp_path / "media"
    folder.mkdir()
    (folder / "cat.png").write_bytes(PNG)
    os.mkfifo(folder / "pipe.png")
    env = {"SMG_VLLM_MM_PROCESSOR": "inprocess", "ENGINELINK_ALLOWED_LOCAL_MEDIA_PATH": str(folder),
           "SMG_VLLM_MM_FETCH_TIMEOUT_MS": "3000"}
    servicer = limited_servicer(tmp_path, test_model_dir, env).start()
    try:
        def fifo_call(i: int) -> grpc.RpcError:
            request = _request(f"file://{folder}/pipe.png")
            request.request_id = f"fifo-{i}"
            return _status(servicer, request)

        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            errors = list(pool.map(fifo_call, range(60)))
        assert time.monotonic() - started < 20
        for error in errors:
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
            assert "media_refs.items[0]" in error.details() and "a FIFO" in error.details()
        error = _status(servicer, _request(f"file://{folder}/cat%00.png"))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert "media_refs.items[0]" in error.details() and "NUL" in error.details()
        # The good file still goes through the fetch (then the sim engine's missing processor refuses it).
        error = _status(servicer, _request(f"file://{folder}/cat.png"))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
        assert "Traceback" not in servicer.log()  # nothing was taken for our bug
        servicer.signal(signal.SIGTERM)
        assert servicer.wait(30) == 0
    finally:
        servicer.stop()
