"""An image through enginelink into a real vLLM 0.32 engine on CPU: the same tokens as vLLM offline.

The vision test model (``enginelink make-test-model --vision``, BLIP-2) is
built twice and compared byte for byte. The router's part (preprocessing)
is done here by the model's own HF processor in the vLLM venv, as the SMG
router does for the families it knows: the pixel tensor (bfloat16, the
model's dtype), the prompt with its placeholders expanded, the placeholder
range. enginelink turns that ``mm_inputs`` into the engine's ``mm_features``;
greedy output for two different images must equal vLLM's offline ``LLM``
given the same images, and differ between the images.

The same servicer also takes the images as ``media_refs`` (the router's
form when the worker processes media: a ``data:`` URL, and an ``http`` URL
served by a loopback origin started here, allowed with
``SMG_MM_ALLOW_PRIVATE_MEDIA_HOSTS=1``): fetched, run through the model's own
vLLM processor in the helper process (runtime/requests/media_processor.py),
they give the same tokens again; media the model's processor refuses is
INVALID_ARGUMENT, and a killed helper is replaced for the next request.

Then the real SMG router 1.13.0 in front of the same servicer (this module,
not tests/router/, so the vision engine starts once in its own CI scope): a
chat with an image by data URL and by http URL, which the router forwards as
``media_refs`` (it has no media spec for BLIP-2; ``--mm-processing worker``),
gives vLLM offline's tokens for the chat template's prompt and the image.
"""

from __future__ import annotations

import base64
import os
import signal

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2 as pb
from tokenizers import Tokenizer

from enginelink.tools.test_vision_model import NUM_QUERY_TOKENS
from tests.adversarial.media_origin import Origin
from tests.harness import Router, Servicer, free_port, generate_request, scrape, wait_until
from tests.router.openai_http import post
from tests.vllm.conftest import START_TIMEOUT_S
from tests.vllm.vision_offline import MAX_TOKENS, PROMPT

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

@pytest.fixture(scope="module")
def offline(vision_offline):
    return vision_offline


@pytest.fixture(scope="module")
def tokenizer(vision_model):
    return Tokenizer.from_file(str(vision_model / "tokenizer.json"))


def _request(case: dict, request_id: str) -> pb.GenerateRequest:
    request = generate_request(request_id, case["prompt_ids"], max_tokens=MAX_TOKENS, temperature=0.0)
    mm = request.mm_inputs
    mm.modality = common_pb2.IMAGE
    mm.pixel_values.dtype = "bfloat16"
    mm.pixel_values.shape.extend(case["shape"])
    mm.pixel_values.inline = base64.b64decode(case["pixels"])
    mm.batched_keys.append("pixel_values")
    image_id = case["prompt_ids"][0]
    assert case["prompt_ids"][:NUM_QUERY_TOKENS] == [image_id] * NUM_QUERY_TOKENS  # BLIP-2 puts the image first
    mm.mm_placeholders.add(offset=0, length=NUM_QUERY_TOKENS)
    mm.im_token_id = image_id
    return request


def _media_request(case: dict, request_id: str, url: str) -> pb.GenerateRequest:
    """The router's worker-side form: the text's tokens (no image tokens yet) and the image by URL."""
    request = generate_request(request_id, case["prompt_ids"][NUM_QUERY_TOKENS:], max_tokens=MAX_TOKENS,
                               temperature=0.0)  # fmt: skip
    request.media_refs.items.add(modality=common_pb2.IMAGE, url=url)
    return request


def _dead(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _helper_pid(servicer_pid: int) -> int:
    """The media processor helper among the servicer's children (/proc: Linux only, as the engine tests)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{entry}/stat").read()
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
        except OSError:
            continue
        if b"media_processor_child.py" in cmdline and int(stat.rsplit(")", 1)[1].split()[1]) == servicer_pid:
            found.append(int(entry))
    assert len(found) == 1, found
    return found[0]


def _sample(samples: dict[str, float], name: str, *labels: str) -> float:
    return sum(value for key, value in samples.items()
               if key.split("{")[0] == name and all(label in key for label in labels))  # fmt: skip


@pytest.fixture(scope="module")
def origin():
    with Origin() as running:
        yield running


@pytest.fixture(scope="module")
def servicer(vision_model, offline, origin, tmp_path_factory):
    """One servicer on the vision model, media refs on, loopback origins allowed, a metrics endpoint."""
    metrics_port = free_port()
    running = Servicer(tmp_path_factory.mktemp("vision"), model_dir=vision_model,
                       extra=["--engine", "vllm", "--metrics-port", str(metrics_port)],
                       engine_args=["--max-model-len", "512", "--enforce-eager"],
                       env={"ENGINELINK_WARMUP": "off", "ENGINELINK_DRAIN_SECS": "0.5",
                            "SMG_VLLM_MM_PROCESSOR": "inprocess", "SMG_MM_ALLOW_PRIVATE_MEDIA_HOSTS": "1"})
    running.metrics_port = metrics_port
    for index, case in enumerate(offline):
        origin.routes[f"/image-{index}.png"] = (200, {"Content-Type": "image/png"}, base64.b64decode(case["png"]))
    running.start(timeout_s=START_TIMEOUT_S)
    try:
        yield running
    finally:
        running.stop()


def test_an_image_through_enginelink_gives_vllm_offlines_tokens(servicer, offline, origin):
    assert offline[0]["output_ids"] != offline[1]["output_ids"]  # the image matters to this model
    metrics_port = servicer.metrics_port
    before = scrape(metrics_port)
    hits_before = len(origin.hits)
    for index, case in enumerate(offline):
        data_url = "data:image/png;base64," + case["png"]
        for kind, url in (("data", data_url), ("http", origin.url(f"/image-{index}.png"))):
            replies = list(servicer.stub.Generate(_media_request(case, f"ref-{kind}-{index}", url), timeout=300))
            assert list(replies[-1].complete.output_ids) == case["output_ids"], (kind, servicer.log()[-3000:])
            assert replies[-1].complete.prompt_tokens == len(case["prompt_ids"])  # the placeholders counted
    assert origin.hits[hits_before:] == ["/image-0.png", "/image-1.png"]
    # Media past the engine's own bounds, refused before any fetch (the engine's resolved limits, its facts):
    # BLIP-2 takes one image per prompt, and no video.
    two = _media_request(offline[0], "ref-two", data_url)
    two.media_refs.items.add(modality=common_pb2.IMAGE, url=data_url)
    video = _media_request(offline[0], "ref-video", "data:video/mp4;base64," + base64.b64encode(b"mp4").decode())
    video.media_refs.items[0].modality = common_pb2.VIDEO
    for request, words in ((two, "media_refs: 2 image item(s); at most 1 per request (the engine's limit: "
                                 "--limit-mm-per-prompt, within what the model takes)"),
                           (video, "media_refs: 1 video item(s); this model takes no video input")):
        with pytest.raises(grpc.RpcError) as error:
            list(servicer.stub.Generate(request, timeout=120))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
        assert words in error.value.details(), error.value.details()
    # The helper killed between requests. A multi-threaded process (torch's threads) is not reapable until
    # every thread has gone, so the next request may still find it "alive" and be the one that meets its
    # death: that request alone is UNAVAILABLE, saying so; at the latest the one after gets a fresh helper.
    helper = _helper_pid(servicer.process.pid)
    os.kill(helper, signal.SIGKILL)
    wait_until(lambda: _dead(helper), 30, "the killed helper to be dead")
    after_kill = 0
    for attempt in range(2):
        after_kill += 1
        try:
            replies = list(servicer.stub.Generate(_media_request(offline[1], f"ref-after-kill-{attempt}", data_url),
                                                  timeout=300))  # fmt: skip
        except grpc.RpcError as error:
            assert attempt == 0 and error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
            assert "the media processor died during this request" in error.details(), error.details()
            continue
        assert list(replies[-1].complete.output_ids) == offline[1]["output_ids"]
        break
    assert _helper_pid(servicer.process.pid) != helper
    samples = scrape(metrics_port)

    def delta(name: str, *labels: str) -> float:
        return _sample(samples, name, *labels) - _sample(before, name, *labels)

    assert delta("smg_servicer_media_processor_starts_total") == (2 if hits_before == 0 else 1)
    assert delta("smg_servicer_media_process_seconds_count") == 4 + after_kill
    assert delta("smg_servicer_media_fetches_total", 'outcome="ok"', 'scheme="data"') == 2 + after_kill
    assert delta("smg_servicer_media_fetches_total", 'outcome="ok"', 'scheme="http"') == 2
    assert delta("smg_servicer_media_fetch_seconds_count") == 4 + after_kill
    assert delta("smg_servicer_media_refusals_total", 'reason="too_many_items"') == 2
    assert delta("smg_servicer_media_refusals_total", 'reason="media_processor_down"') == after_kill - 1
    for index, case in enumerate(offline):
        replies = list(servicer.stub.Generate(_request(case, f"img-{index}"), timeout=120))
        assert list(replies[-1].complete.output_ids) == case["output_ids"], servicer.log()[-3000:]
    # The same image twice in a row: the engine's encoder cache keys on the content hash.
    replies = list(servicer.stub.Generate(_request(offline[0], "img-again"), timeout=120))
    assert list(replies[-1].complete.output_ids) == offline[0]["output_ids"]


@pytest.mark.router
def test_an_image_through_the_real_router_gives_vllm_offlines_tokens(servicer, offline, origin, vision_model,
                                                                      tokenizer, tmp_path):  # fmt: skip
    """HTTP chat with an image → smg 1.13.0 → enginelink → vLLM: the router has no media spec for BLIP-2,
    so under ``--mm-processing worker`` it forwards the URL as ``media_refs`` and this worker processes it."""
    router = Router(tmp_path, servicer.port, vision_model, extra=["--mm-processing", "worker"]).start(timeout_s=60)
    before, hits_before = scrape(servicer.metrics_port), len(origin.hits)
    try:
        for index, case in enumerate(offline):
            for kind, url in (("data", "data:image/png;base64," + case["png"]), ("http", origin.url(f"/image-{index}.png"))):
                status, body = post(router.url, "/v1/chat/completions", {
                    "model": vision_model.name, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "messages": [{"role": "user", "content": [
                        {"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": url}}]}],
                })  # fmt: skip
                assert status == 200, (kind, body, router.log()[-3000:])
                expected = tokenizer.decode(case["chat_output_ids"], skip_special_tokens=True)
                assert body["choices"][0]["message"]["content"] == expected, (kind, body)
                assert body["usage"]["prompt_tokens"] == len(case["chat_prompt_ids"]), (kind, body)
                print(f"router e2e {kind} image {index}: {body['choices'][0]['message']['content']!r} "
                      f"usage={body['usage']}")
        # The router sent the URLs, not tensors: this worker fetched each (the router's own address policy,
        # which refuses loopback, is for media it processes itself) and ran them through the processor.
        assert origin.hits[hits_before:] == ["/image-0.png", "/image-1.png"]
        after = scrape(servicer.metrics_port)
        for scheme in ("data", "http"):
            label = f'scheme="{scheme}"'
            assert _sample(after, "smg_servicer_media_fetches_total", label, 'outcome="ok"') - \
                _sample(before, "smg_servicer_media_fetches_total", label, 'outcome="ok"') == 2, scheme
        assert _sample(after, "smg_servicer_media_process_seconds_count") - \
            _sample(before, "smg_servicer_media_process_seconds_count") == 4
    finally:
        router.stop()
