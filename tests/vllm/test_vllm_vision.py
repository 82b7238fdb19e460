"""An image through enginelink into a real vLLM 0.32 engine on CPU: the same tokens as vLLM offline.

The vision test model (``enginelink make-test-model --vision``, BLIP-2) is
built twice and compared byte for byte. The router's part (preprocessing)
is done here by the model's own HF processor in the vLLM venv, as the SMG
router does for the families it knows: the pixel tensor (bfloat16, the
model's dtype), the prompt with its placeholders expanded, the placeholder
range. enginelink turns that ``mm_inputs`` into the engine's ``mm_features``;
greedy output for two different images must equal vLLM's offline ``LLM``
given the same images, and differ between the images. The real SMG router
is not in front: 1.13.0 preprocesses LLaVA / Qwen-VL / Phi-3-V / Llama 4
families, whose vLLM 0.32 modules need torchvision, which the CPU set-up
removes (docs/limits.md, "Router tensors").
"""

from __future__ import annotations

import base64
import json
import subprocess

import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2 as pb

from enginelink.tools.test_vision_model import NUM_QUERY_TOKENS, make_vision_model
from tests.harness import generate_request
from tests.vllm.conftest import START_TIMEOUT_S, vllm_servicer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

COLORS = [(200, 30, 30), (10, 200, 30)]
PROMPT = "describe the picture"
MAX_TOKENS = 8

OFFLINE = r"""
import base64, json, sys
import torch
from PIL import Image
from transformers import AutoProcessor
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    model, prompt, max_tokens, colors = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    processor = AutoProcessor.from_pretrained(model)
    llm = LLM(model=model, max_model_len=512, enforce_eager=True, kv_cache_memory_bytes=8 << 20, seed=0)
    out = []
    for color in colors:
        image = Image.new("RGB", (64, 48), tuple(color))
        pixels = processor.image_processor(image, return_tensors="pt")["pixel_values"].to(torch.bfloat16)
        result = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}},
                              SamplingParams(max_tokens=max_tokens, temperature=0))[0]
        out.append({"prompt_ids": result.prompt_token_ids, "output_ids": list(result.outputs[0].token_ids),
                    "shape": list(pixels.shape),
                    "pixels": base64.b64encode(pixels.view(torch.int16).numpy().tobytes()).decode()})
    print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory, vllm_python):
    root = tmp_path_factory.mktemp("vision-model")
    first = make_vision_model(root / "a", python=vllm_python)
    second = make_vision_model(root / "b", python=vllm_python)
    for path in sorted(first.iterdir()):
        assert path.read_bytes() == (second / path.name).read_bytes(), f"{path.name} differs between two builds"
    return first


@pytest.fixture(scope="module")
def offline(vision_model, vllm_python, tmp_path_factory):
    done = subprocess.run([vllm_python, "-c", OFFLINE, str(vision_model), PROMPT, str(MAX_TOKENS), json.dumps(COLORS)],
                          capture_output=True, timeout=600)  # fmt: skip
    lines = [line for line in done.stdout.decode().splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr.decode()[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


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


def test_an_image_through_enginelink_gives_vllm_offlines_tokens(vision_model, offline, tmp_path):
    assert offline[0]["output_ids"] != offline[1]["output_ids"]  # the image matters to this model
    servicer = vllm_servicer(tmp_path, vision_model, engine_args=["--max-model-len", "512", "--enforce-eager"],
                             env={"ENGINELINK_WARMUP": "off", "ENGINELINK_DRAIN_SECS": "0.5"})  # fmt: skip
    servicer.start(timeout_s=START_TIMEOUT_S)
    try:
        for index, case in enumerate(offline):
            replies = list(servicer.stub.Generate(_request(case, f"img-{index}"), timeout=120))
            assert list(replies[-1].complete.output_ids) == case["output_ids"], servicer.log()[-3000:]
        # The same image twice in a row: the engine's encoder cache keys on the content hash.
        replies = list(servicer.stub.Generate(_request(offline[0], "img-again"), timeout=120))
        assert list(replies[-1].complete.output_ids) == offline[0]["output_ids"]
    finally:
        servicer.stop()
