"""The vision test model's offline reference, shared by the image modules on the vision scope's worker.

``tests/vllm/test_vllm_vision.py`` and ``tests/vllm/test_vllm_media_sidecar.py``
compare enginelink with vLLM's offline ``LLM`` on the same model, the same two
images and the same chat prompt: one build of the model (twice, compared byte
for byte) and one offline run serve both (``vision_model`` and
``vision_offline`` in ``tests/vllm/conftest.py``, session fixtures kept on that
one worker by ``ENGINE_SCOPES``). Each was once its modules' own: an offline
engine start and a model build more on a CPU-bound suite.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tokenizers import Tokenizer

from enginelink.tools.test_vision_model import make_vision_model
from tests.harness import OFFLINE_VLLM_ENV

COLORS = [(200, 30, 30), (10, 200, 30)]
PROMPT = "describe the picture"
CHAT_TEXT = f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"
MAX_TOKENS = 8

OFFLINE = r"""
import base64, io, json, sys
import torch
from PIL import Image
from transformers import AutoProcessor
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    model, prompt, max_tokens, colors = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    chat_ids = json.loads(sys.argv[5])  # the chat template's tokens, as the router renders and sends them
    processor = AutoProcessor.from_pretrained(model)
    llm = LLM(model=model, max_model_len=512, enforce_eager=True, kv_cache_memory_bytes=8 << 20, seed=0)
    out = []
    for color in colors:
        image = Image.new("RGB", (64, 48), tuple(color))
        pixels = processor.image_processor(image, return_tensors="pt")["pixel_values"].to(torch.bfloat16)
        png = io.BytesIO()
        image.save(png, format="PNG")
        result = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}},
                              SamplingParams(max_tokens=max_tokens, temperature=0))[0]
        chat = llm.generate({"prompt_token_ids": chat_ids, "multi_modal_data": {"image": image}},
                            SamplingParams(max_tokens=max_tokens, temperature=0))[0]
        out.append({"prompt_ids": result.prompt_token_ids, "output_ids": list(result.outputs[0].token_ids),
                    "chat_prompt_ids": chat.prompt_token_ids, "chat_output_ids": list(chat.outputs[0].token_ids),
                    "shape": list(pixels.shape), "png": base64.b64encode(png.getvalue()).decode(),
                    "pixels": base64.b64encode(pixels.view(torch.int16).numpy().tobytes()).decode()})
    print("RESULT " + json.dumps(out))
"""




def build_vision_model(root: Path, python: str) -> Path:
    """The vision test model, built twice (seeded, offline): the two builds must be the same bytes."""
    first = make_vision_model(root / "a", python=python)
    second = make_vision_model(root / "b", python=python)
    for path in sorted(first.iterdir()):
        assert path.read_bytes() == (second / path.name).read_bytes(), f"{path.name} differs between two builds"
    return first


def chat_ids(model: Path) -> list[int]:
    """The test model's ChatML for one user turn with an image part, rendered by hand as the router renders it."""
    return Tokenizer.from_file(str(model / "tokenizer.json")).encode(CHAT_TEXT, add_special_tokens=True).ids


def run_offline(model: Path, python: str) -> list[dict]:
    """vLLM offline on both images: tokens for the plain and the chat prompt, the pixels and the PNG."""
    done = subprocess.run([python, "-c", OFFLINE, str(model), PROMPT, str(MAX_TOKENS), json.dumps(COLORS),
                           json.dumps(chat_ids(model))], capture_output=True, timeout=600,
                          env={**os.environ, **OFFLINE_VLLM_ENV})  # fmt: skip
    lines = [line for line in done.stdout.decode().splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr.decode()[-4000:]
    return json.loads(lines[-1][len("RESULT "):])
