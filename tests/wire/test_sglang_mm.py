"""Router-preprocessed images on SGLang's contract (``runtime/contracts/sglang/mm_inputs.py``), against SGLang's own code.

Real-package half (the struct-only SGLang venv; one peer process,
``sglang_mm_peer.py``): the request our codec writes for an image decodes
with SGLang's own ``msgpack_decode`` into the ``MultimodalProcessorOutput``
the reference servicer builds (one IMAGE item, the pixels as a torch tensor
of the router's dtype, shape and values, the other tensors as its
model-specific data, inclusive offsets, the image token id), which the
scheduler's own ``MultimodalInputs.from_processor_output`` prepares and whose
offsets its ``build_token_modalities`` accepts; and the launch script's
``image_understanding`` answers as SGLang's model config does (a text model
no, a LLaVA config yes, under ``--language-model-only`` no). Pure half: what
is refused, naming the field.
"""

from __future__ import annotations

import base64
import json
import shutil
import struct
import subprocess

import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from enginelink.runtime.contracts.sglang.sglang_headless import __file__ as HEADLESS_SCRIPT
from enginelink.runtime.errors import ClientError
from enginelink.runtime.contracts.sglang.edge import validate_generate
from enginelink.runtime.requests.validate import EngineLimits
from enginelink.wire import sglang_structs as s
from enginelink.wire.sglang import SglangCodec
from tests.wire.engine_venvs import side_python_or_skip

PROMPT = [1, 2, 7, 7, 7, 7, 3, 4]
LIMITS = EngineLimits(max_model_len=128, vocab_size=4096, eos_token_ids=(2,), supports_vision=True)
PIXELS = [i / 8 for i in range(12)]  # exact in float32 and bfloat16


def bf16(values: list[float]) -> bytes:
    return b"".join(struct.pack("<f", v)[2:] for v in values)  # the high half of each float32


def image_request(dtype: str = "float32", **changes) -> pb.GenerateRequest:
    data = struct.pack("<12f", *PIXELS) if dtype == "float32" else bf16(PIXELS)
    mm = pb.MultimodalInputs(
        pixel_values=pb.TensorData(data=data, shape=[1, 3, 2, 2], dtype=dtype),
        model_specific_tensors={"image_sizes": pb.TensorData(data=struct.pack("<2q", 2, 2), shape=[1, 2],
                                                             dtype="int64")},
        im_token_id=7, mm_placeholders=[pb.PlaceholderRange(offset=2, length=4)])
    for name, value in changes.items():
        if isinstance(value, list):
            getattr(mm, name).extend(value)
        else:
            setattr(mm, name, value)
    return pb.GenerateRequest(request_id="img", tokenized=pb.TokenizedInput(input_ids=PROMPT), mm_inputs=mm,
                              sampling_params=pb.SamplingParams(temperature=0, max_new_tokens=4))


def frame(request: pb.GenerateRequest, limits: EngineLimits = LIMITS) -> bytes:
    call = validate_generate(request, limits, 0.0)
    return SglangCodec().encode_add(call.specs[0])[0]


def make_llava(root, test_model_dir):
    """A LLaVA checkpoint's config (no weights: SGLang's model config reads only the config)."""
    folder = root / "llava"
    folder.mkdir()
    config = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "image_token_index": 7,
              "vision_config": {"model_type": "clip_vision_model", "hidden_size": 64, "image_size": 56,
                                "patch_size": 14, "num_hidden_layers": 1, "num_attention_heads": 2,
                                "intermediate_size": 128},
              "text_config": json.loads((test_model_dir / "config.json").read_text())}
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(test_model_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def peer(tmp_path_factory, test_model_dir):
    python = side_python_or_skip("sglang")
    tmp = tmp_path_factory.mktemp("sglang-mm")
    llava = make_llava(tmp, test_model_dir)
    cases = [{"id": f"request:{dtype}", "op": "request", "frame": base64.b64encode(frame(image_request(dtype))).decode()}
             for dtype in ("float32", "bfloat16")]
    cases += [{"id": "vision:text", "op": "vision", "script": HEADLESS_SCRIPT, "argv": ["--model-path", str(test_model_dir)]},
              {"id": "vision:llava", "op": "vision", "script": HEADLESS_SCRIPT, "argv": ["--model-path", str(llava)]},
              {"id": "vision:llava_lm_only", "op": "vision", "script": HEADLESS_SCRIPT,
               "argv": ["--model-path", str(llava), "--language-model-only"]}]  # fmt: skip
    (tmp / "cases.json").write_text(json.dumps(cases))
    done = subprocess.run([python, str(__import__("pathlib").Path(__file__).with_name("sglang_mm_peer.py")),
                           str(tmp / "cases.json"), str(tmp / "results.json")],
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp / "results.json").read_text())


@pytest.mark.process
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sglang_decodes_and_prepares_our_image_request_as_the_reference_builds_it(peer, dtype):
    got = peer[f"request:{dtype}"]
    assert "error" not in got, got
    assert (got["type"], got["mm_type"], got["items"], got["modality"]) == (
        "TokenizedGenerateReqInput", "MultimodalProcessorOutput", 1, "IMAGE")
    assert got["feature"] == {"dtype": dtype, "shape": [1, 3, 2, 2], "values": PIXELS}
    assert got["model_specific_data"] == {"image_sizes": {"dtype": "int64", "shape": [1, 2], "values": [2.0, 2.0]}}
    assert got["offsets"] == [[2, 5]] and got["im_token_id"] == 7
    assert got["prepared_images"] and got["pad_value_set"]  # the scheduler's own preparation took it
    assert got["token_modalities"] == [0, 0, 1, 1, 1, 1, 0, 0]  # IMAGE (1) exactly on the placeholders


@pytest.mark.process
def test_the_launch_script_asks_sglangs_model_config_whether_the_model_takes_images(peer):
    assert peer["vision:text"] == {"supports_vision": False}
    assert peer["vision:llava"] == {"supports_vision": True}, peer["vision:llava"]
    assert peer["vision:llava_lm_only"] == {"supports_vision": False}


# ---- the pure half -------------------------------------------------------------------------


def test_the_image_becomes_the_schedulers_mm_inputs():
    call = validate_generate(image_request(), LIMITS, 0.0)
    mm = call.specs[0].mm_inputs
    (item,) = mm.mm_items
    assert (item.modality, item.offsets, mm.im_token_id) == (s.MODALITY_IMAGE, [(2, 5)], 7)
    assert s.unpack_tensor(item.feature.data) == ((1, 3, 2, 2), "float32", struct.pack("<12f", *PIXELS))
    assert s.unpack_tensor(item.model_specific_data["image_sizes"].data)[:2] == ((1, 2), "int64")
    assert validate_generate(pb.GenerateRequest(request_id="t", tokenized=pb.TokenizedInput(input_ids=PROMPT)),
                             LIMITS, 0.0).specs[0].mm_inputs is None


REFUSED = [
    ("a text model", {}, {"supports_vision": False}, "mm_inputs", "takes no images"),
    ("a URL to fetch", {"image_urls": ["http://x/a.png"]}, {}, "mm_inputs.image_urls", "router preprocesses"),
    ("raw image bytes", {"image_data": [b"\x89PNG"]}, {}, "mm_inputs.image_data", "router preprocesses"),
    ("a video", {"modalities": ["video"]}, {}, "mm_inputs.modalities", "only images"),
    ("bytes that do not fit the shape", {"pixel_values": pb.TensorData(data=b"\x00" * 7, shape=[1, 2], dtype="float32")},
     {}, "mm_inputs.pixel_values", "expected 8"),
    ("an unknown dtype", {"pixel_values": pb.TensorData(data=b"\x00" * 8, shape=[1, 2], dtype="float64")},
     {}, "mm_inputs.pixel_values", "dtype"),
    ("a placeholder past the prompt", {"mm_placeholders": [pb.PlaceholderRange(offset=6, length=4)]}, {},
     "mm_inputs.mm_placeholders", "does not lie in"),
    ("overlapping placeholders", {"mm_placeholders": [pb.PlaceholderRange(offset=3, length=2)]}, {},
     "mm_inputs.mm_placeholders", "overlaps"),
    ("an empty placeholder", {"mm_placeholders": [pb.PlaceholderRange(offset=6, length=0)]}, {},
     "mm_inputs.mm_placeholders", "does not lie in"),
    ("more images than the engine's limit", {"mm_placeholders": [pb.PlaceholderRange(offset=6, length=1)]},
     {"mm_item_limits": {"image": 1}}, "mm_inputs.mm_placeholders", "--limit-mm-data-per-request"),
    ("an image token outside the vocabulary", {"im_token_id": 10**6}, {}, "mm_inputs.im_token_id", "vocabulary"),
]


@pytest.mark.parametrize("changes, limits, field, words", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_what_the_scheduler_cannot_take_is_refused_naming_the_field(changes, limits, field, words):
    from dataclasses import replace

    request = image_request(**{k: v for k, v in changes.items() if k != "pixel_values"})
    if "pixel_values" in changes:
        request.mm_inputs.pixel_values.CopyFrom(changes["pixel_values"])
    with pytest.raises(ClientError) as refused:
        validate_generate(request, replace(LIMITS, **limits), 0.0)
    assert refused.value.field == field and words in str(refused.value), str(refused.value)


def test_no_pixels_and_too_many_tensor_bytes_are_refused(monkeypatch):
    request = image_request()
    request.mm_inputs.ClearField("pixel_values")
    with pytest.raises(ClientError, match="required"):
        validate_generate(request, LIMITS, 0.0)
    from enginelink.runtime.contracts.shared.media import media_settings

    monkeypatch.setenv("ENGINELINK_MM_MAX_TENSOR_BYTES", "50")  # the pixels (48) fit, not with the sizes (16)
    media_settings.cache_clear()  # read once a process: this one reads it again
    try:
        with pytest.raises(ClientError) as refused:
            validate_generate(image_request(), LIMITS, 0.0)
    finally:
        monkeypatch.undo()
        media_settings.cache_clear()
    assert "ENGINELINK_MM_MAX_TENSOR_BYTES" in str(refused.value) and "image_sizes" in refused.value.field
