"""Images on SGLang's contract through ``serve --engine sim --wire sglang``: what a client sees.

The router preprocesses an image and sends SGLang's ``MultimodalInputs``
(pixel tensors, placeholder ranges, the image token id); the servicer hands
the scheduler its own ``MultimodalProcessorOutput`` (``runtime/contracts/sglang/mm_inputs.py``;
decoded by SGLang's own code in ``tests/wire/test_sglang_mm.py``). The sim's
SGLang personality checks it as the scheduler finds it and pads the
placeholders from the image's bytes, so the same image gives the same
tokens and another image others. ``GetModelInfo.supports_vision`` and
``GetServerInfo``'s ``mm_item_limits`` come from the engine's report and its
``--limit-mm-data-per-request``; a text model's worker refuses images.
"""

from __future__ import annotations

import json
import shutil
import struct

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb, sglang_scheduler_pb2_grpc as pb_grpc

from tests.harness import Servicer

pytestmark = pytest.mark.process  # starts processes: not in the fast loop (tests/fast_loop.py)

SERVICE = "sglang.grpc.scheduler.SglangScheduler"
PROMPT = [11, 12, 99, 99, 99, 99, 13, 14]


def vision_model(root, text_model):
    """The text test model with a vision tower in its config (what the sim reads as "takes images")."""
    folder = root / "vision-model"
    shutil.copytree(text_model, folder)
    config = json.loads((folder / "config.json").read_text())
    config["vision_config"] = {"model_type": "clip_vision_model", "image_size": 56, "patch_size": 14}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def image(seed: float, placeholders=((2, 4),)) -> pb.MultimodalInputs:
    pixels = struct.pack("<12f", *[seed + i / 8 for i in range(12)])
    return pb.MultimodalInputs(pixel_values=pb.TensorData(data=pixels, shape=[1, 3, 2, 2], dtype="float32"),
                               im_token_id=99,
                               mm_placeholders=[pb.PlaceholderRange(offset=o, length=n) for o, n in placeholders])


def generate(stub, mm: pb.MultimodalInputs | None, request_id: str) -> list[int]:
    request = pb.GenerateRequest(request_id=request_id, tokenized=pb.TokenizedInput(input_ids=PROMPT),
                                 sampling_params=pb.SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
    if mm is not None:
        request.mm_inputs.CopyFrom(mm)
    (complete,) = [r.complete for r in stub.Generate(request, timeout=30) if r.WhichOneof("response") == "complete"]
    return list(complete.output_ids)


@pytest.fixture(scope="module")
def vision(tmp_path_factory, test_model_dir):
    tmp = tmp_path_factory.mktemp("sglang-vision")
    servicer = Servicer(tmp, model_dir=vision_model(tmp, test_model_dir), extra=["--engine", "sim", "--wire", "sglang"],
                        engine_args=["--limit-mm-data-per-request", '{"image": 1, "video": 2}'],
                        health_service=SERVICE, env={"ENGINELINK_WARMUP": "off"}).start()  # fmt: skip
    try:
        yield pb_grpc.SglangSchedulerStub(servicer.channel)
    finally:
        servicer.stop()


def test_a_vision_model_says_so_and_advertises_the_engines_media_limits(vision):
    assert vision.GetModelInfo(pb.GetModelInfoRequest(), timeout=5).supports_vision
    args = dict(vision.GetServerInfo(pb.GetServerInfoRequest(), timeout=5).server_args)
    assert args["mm_item_limits"] == "image=1,video=2"  # the reference's label: modality order, flat


def test_the_image_reaches_the_scheduler_and_decides_the_tokens(vision):
    text = generate(vision, None, "text")
    first = generate(vision, image(0.0), "a1")
    assert generate(vision, image(0.0), "a2") == first  # the same image: the same tokens
    assert generate(vision, image(5.0), "b") != first  # another image: others
    assert first != text and len(first) == 6


def test_more_images_than_the_engine_takes_are_refused(vision):
    with pytest.raises(grpc.RpcError) as refused:
        generate(vision, image(0.0, placeholders=((2, 2), (4, 2))), "two")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "mm_inputs.mm_placeholders" in refused.value.details() and "--limit-mm-data-per-request" in \
        refused.value.details()


def test_a_text_models_worker_refuses_an_image(tmp_path, test_model_dir):
    servicer = Servicer(tmp_path, model_dir=test_model_dir, extra=["--engine", "sim", "--wire", "sglang"],
                        health_service=SERVICE, env={"ENGINELINK_WARMUP": "off"}).start()
    try:
        stub = pb_grpc.SglangSchedulerStub(servicer.channel)
        assert not stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5).supports_vision
        assert "mm_item_limits" not in dict(stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5).server_args)
        with pytest.raises(grpc.RpcError) as refused:
            generate(stub, image(0.0), "img")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "mm_inputs" in refused.value.details() and "takes no images" in refused.value.details()
    finally:
        servicer.stop()
