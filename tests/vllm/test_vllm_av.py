"""A video and an audio clip through enginelink into a real vLLM 0.32 engine on CPU: vLLM offline's tokens.

The tiny video and audio test models (``enginelink make-test-model --video``
/ ``--audio``: Qwen3-VL, Qwen2-Audio) are built here, each twice and
compared byte for byte. The clips are made offline in the vLLM venv (an
MP4 by OpenCV, a WAV by the standard library), two of each that the model
tells apart. vLLM offline is given them as ``vllm serve`` loads a URL
(``MediaConnector.fetch_video`` with the model's video processor,
``fetch_audio``, under the engine's ``--media-io-kwargs``), with the chat
template's prompt the router renders; enginelink gets them as
``media_refs`` (``--mm-processor inprocess``), directly and through the real
SMG router (``--mm-processing worker``), and must give the same tokens. (The
router 1.13.0 takes video for Qwen3-VL only, by ``model_type``: its Qwen2-VL
spec refuses a video chat before any worker is asked, hence Qwen3-VL.)

The video engine runs with ``--media-io-kwargs '{"video": {"max_frames": 2}}'``
(Qwen3-VL's loader samples by fps up to that many frames): the tokens equal
offline's under the same kwargs and differ from offline's without them, so
the servicer's processor honours them. Its ``--limit-mm-per-prompt`` (one
video, one image) is advertised in ``GetServerInfo`` with the encoder
budget, and held before the engine: two videos, or an audio clip the model
takes none of, are the client's error naming the bound.
"""

from __future__ import annotations

import json
import os
import subprocess

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2 as pb
from tokenizers import Tokenizer

from enginelink.tools.test_media_models import make_media_model
from tests.harness import OFFLINE_VLLM_ENV, Router, Servicer, generate_request
from tests.router.openai_http import post
from tests.vllm.conftest import START_TIMEOUT_S

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = "describe it"
MAX_TOKENS = 8
VIDEO_IO_KWARGS = {"video": {"max_frames": 2}}
PLACEHOLDERS = {"video": "<|vision_start|><|video_pad|><|vision_end|>",
                "audio": "<|audio_bos|><|AUDIO|><|audio_eos|>"}  # fmt: skip
# --skip-mm-profiling (and skip_mm_profiling offline): vLLM's start-up otherwise runs the encoder on a
# dummy batch of the largest clips it accepts, to size memory on an accelerator; on CPU that was most of
# each engine start here, and it changes no token.
ENGINE_ARGS = {
    "video": ["--max-model-len", "1024", "--enforce-eager", "--skip-mm-profiling", "--limit-mm-per-prompt",
              '{"image": 1, "video": 1}', "--media-io-kwargs", json.dumps(VIDEO_IO_KWARGS)],
    "audio": ["--max-model-len", "1024", "--enforce-eager", "--skip-mm-profiling", "--limit-mm-per-prompt",
              '{"audio": 1}'],
}

OFFLINE = r"""
import base64, io, json, sys, tempfile, wave
import numpy as np

def video(color, frames=8, size=56, fps=4):
    import cv2
    path = tempfile.mktemp(suffix=".mp4")
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (size, size))
    for i in range(frames):
        img = np.zeros((size, size, 3), np.uint8)
        img[:] = color
        img[: (i + 1) * size // frames, :, 0] = 255 - color[0]  # a bar that grows: the frames differ
        writer.write(img)
    writer.release()
    return open(path, "rb").read()

def audio(freq, seconds=1.0, sr=16000):
    t = np.arange(int(sr * seconds)) / sr
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1); w.setsampwidth(2); w.setframerate(sr)
        w.writeframes((0.5 * np.sin(2 * np.pi * freq * t) * 32767).astype("<i2").tobytes())
    return buf.getvalue()

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.multimodal.media import MediaConnector
    from vllm.transformers_utils.processor import get_video_processor_cls_name
    kind, model, ids, io_kwargs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
    limits = {"image": 1, "video": 1} if kind == "video" else {"audio": 1}
    llm = LLM(model=model, max_model_len=1024, enforce_eager=True, kv_cache_memory_bytes=16 << 20, seed=0,
              limit_mm_per_prompt=limits, media_io_kwargs=io_kwargs or None, skip_mm_profiling=True)
    name = get_video_processor_cls_name(llm.llm_engine.model_config) if kind == "video" else None
    out = []
    for clip in ([(200, 30, 30), (10, 200, 30)] if kind == "video" else [220, 880]):
        data = video(clip) if kind == "video" else audio(clip)
        mime = "video/mp4" if kind == "video" else "audio/wav"
        url = f"data:{mime};base64," + base64.b64encode(data).decode()
        case = {"data": base64.b64encode(data).decode(), "mime": mime}
        # As vllm serve loads a URL: the engine's media kwargs, the model's own video loader (and, where the
        # engine has media kwargs, vLLM's defaults too: the tokens must differ, so the kwargs matter).
        for label, kwargs in (("output_ids", io_kwargs), ("default_output_ids", {}))[: 2 if io_kwargs else 1]:
            conn = MediaConnector(media_io_kwargs=kwargs)
            item = conn.fetch_video(url, video_processor=name) if kind == "video" else conn.fetch_audio(url)
            result = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {kind: [item]}},
                                  SamplingParams(max_tokens=8, temperature=0))[0]
            case[label] = list(result.outputs[0].token_ids)
            case.setdefault("prompt_ids", list(result.prompt_token_ids))
        out.append(case)
    print("RESULT " + json.dumps(out))
"""


def chat_ids(tokenizer: Tokenizer, kind: str) -> list[int]:
    """The model's chat template for one user turn (the clip, then the text), as the router renders it."""
    text = f"<|im_start|>user\n{PLACEHOLDERS[kind]}{PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    return tokenizer.encode(text, add_special_tokens=True).ids


class Case:
    def __init__(self, kind: str, model, tokenizer: Tokenizer, offline: list[dict], servicer: Servicer):
        self.kind, self.model, self.tokenizer, self.offline, self.servicer = kind, model, tokenizer, offline, servicer

    def ref_request(self, index: int, request_id: str, *urls: str) -> pb.GenerateRequest:
        request = generate_request(request_id, chat_ids(self.tokenizer, self.kind), max_tokens=MAX_TOKENS,
                                   temperature=0.0)  # fmt: skip
        modality = common_pb2.VIDEO if self.kind == "video" else common_pb2.AUDIO
        for url in urls or (self.url(index),):
            request.media_refs.items.add(modality=modality, url=url)
        return request

    def url(self, index: int) -> str:
        case = self.offline[index]
        return f"data:{case['mime']};base64,{case['data']}"


@pytest.fixture(scope="module", params=["video", "audio"])
def case(request, tmp_path_factory, vllm_python):
    kind = request.param
    root = tmp_path_factory.mktemp(f"{kind}-model")
    model = make_media_model(kind, root / "model", python=vllm_python)
    again = make_media_model(kind, root / "again", python=vllm_python)  # seeded and offline: the same bytes
    assert sorted(path.name for path in again.iterdir()) == sorted(path.name for path in model.iterdir())
    for path in sorted(model.iterdir()):
        assert path.read_bytes() == (again / path.name).read_bytes(), f"{path.name} differs between two builds"
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    io_kwargs = VIDEO_IO_KWARGS if kind == "video" else {}
    # vLLM offline and the servicer's engine start side by side (each mostly waits on its own start-up): the
    # module's two engine starts per clip kind overlap instead of adding up.
    logs = tmp_path_factory.mktemp(f"{kind}-offline")
    with open(logs / "stdout", "wb") as out, open(logs / "stderr", "wb") as err:
        reference = subprocess.Popen([vllm_python, "-c", OFFLINE, kind, str(model),
                                      json.dumps(chat_ids(tokenizer, kind)), json.dumps(io_kwargs)],
                                     stdout=out, stderr=err, env={**os.environ, **OFFLINE_VLLM_ENV})  # fmt: skip
    servicer = Servicer(tmp_path_factory.mktemp(kind), model_dir=model, extra=["--engine", "vllm"],
                        engine_args=ENGINE_ARGS[kind],
                        env={"ENGINELINK_WARMUP": "off", "ENGINELINK_DRAIN_SECS": "0.5",
                             "SMG_VLLM_MM_PROCESSOR": "inprocess"})  # fmt: skip
    try:
        servicer.start(timeout_s=START_TIMEOUT_S)
        try:
            returncode = reference.wait(timeout=900)
        finally:
            if reference.poll() is None:
                reference.kill()
                reference.wait()
        lines = [line for line in (logs / "stdout").read_text(errors="replace").splitlines()
                 if line.startswith("RESULT ")]  # fmt: skip
        assert returncode == 0 and lines, (logs / "stderr").read_text(errors="replace")[-4000:]
        offline = json.loads(lines[-1][len("RESULT "):])
        yield Case(kind, model, tokenizer, offline, servicer)
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.wait()
        servicer.stop()


def test_media_refs_give_vllm_offlines_tokens_and_the_engines_bounds_hold_before_it(case):
    offline = case.offline
    assert offline[0]["output_ids"] != offline[1]["output_ids"], offline  # the clip matters to this model
    for index, expected in enumerate(offline):
        replies = list(case.servicer.stub.Generate(case.ref_request(index, f"{case.kind}-{index}"), timeout=300))
        assert list(replies[-1].complete.output_ids) == expected["output_ids"], case.servicer.log()[-3000:]
        assert replies[-1].complete.prompt_tokens == len(expected["prompt_ids"])  # the placeholders counted
        print(f"{case.kind} {index}: enginelink {list(replies[-1].complete.output_ids)} "
              f"offline {expected['output_ids']} prompt_tokens {replies[-1].complete.prompt_tokens}")
    info = case.servicer.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
    assert info.mm_item_limits == ("image=1,video=1" if case.kind == "video" else "audio=1"), info
    assert info.mm_encoder_budget > 0 and info.mm_processor == "inprocess", info
    other = "data:audio/wav;base64,AAAA" if case.kind == "video" else "data:video/mp4;base64,AAAA"
    wrong = case.ref_request(0, f"{case.kind}-other")
    wrong.media_refs.items[0].modality = common_pb2.AUDIO if case.kind == "video" else common_pb2.VIDEO
    wrong.media_refs.items[0].url = other
    other_kind = "audio" if case.kind == "video" else "video"
    for request, words in (
        (case.ref_request(0, f"{case.kind}-two", case.url(0), case.url(1)),
         f"media_refs: 2 {case.kind} item(s); at most 1 per request (the engine's limit: --limit-mm-per-prompt, within what the model takes)"),
        (wrong, f"media_refs: 1 {other_kind} item(s); this model takes no {other_kind} input"),
    ):  # fmt: skip
        with pytest.raises(grpc.RpcError) as error:
            list(case.servicer.stub.Generate(request, timeout=120))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
        assert error.value.details() == words


@pytest.mark.parametrize("case", ["video"], indirect=True)  # only the video engine has media kwargs
def test_media_io_kwargs_and_the_frame_cap_change_the_sampled_video(case):
    """The video engine's --media-io-kwargs (at most 2 frames) reached the servicer's processor: its tokens are
    offline's under the same kwargs, and those differ from offline's without them."""
    assert any(c["output_ids"] != c["default_output_ids"] for c in case.offline), case.offline
    replies = list(case.servicer.stub.Generate(case.ref_request(1, "video-kwargs"), timeout=300))
    assert list(replies[-1].complete.output_ids) == case.offline[1]["output_ids"]


@pytest.mark.router
def test_a_clip_through_the_real_router_gives_vllm_offlines_tokens(case, tmp_path):
    """HTTP chat with a clip → smg 1.13.0 (``--mm-processing worker``) → enginelink → vLLM: offline's tokens."""
    router = Router(tmp_path, case.servicer.port, case.model, extra=["--mm-processing", "worker"]).start(timeout_s=60)
    try:
        for index, expected in enumerate(case.offline):
            if case.kind == "video":
                part = {"type": "video_url", "video_url": {"url": case.url(index)}}
            else:
                part = {"type": "input_audio", "input_audio": {"data": expected["data"], "format": "wav"}}
            status, body = post(router.url, "/v1/chat/completions", {
                "model": case.model.name, "max_tokens": MAX_TOKENS, "temperature": 0,
                "messages": [{"role": "user", "content": [part, {"type": "text", "text": PROMPT}]}],
            })  # fmt: skip
            assert status == 200, (body, router.log()[-3000:], case.servicer.log()[-2000:])
            words = case.tokenizer.decode(expected["output_ids"], skip_special_tokens=True)
            assert body["choices"][0]["message"]["content"] == words, body
            assert body["usage"]["prompt_tokens"] == len(expected["prompt_ids"]), body
            print(f"router e2e {case.kind} {index}: {body['choices'][0]['message']['content']!r} usage={body['usage']}")
    finally:
        router.stop()
