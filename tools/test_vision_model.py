"""``enginelink make-test-model --vision DIR``: a tiny vision-language model vLLM 0.32 runs on CPU.

BLIP-2 (a 2-layer ViT, a 1-layer Q-Former, 4 query tokens) in front of the
text test model's Llama shape and tokenizer (plus an ``<image>`` token),
random weights, with transformers' own config, ``Blip2Processor`` (its PIL
image processor, 56x56) and a chat template that places the image. Why
BLIP-2: vLLM 0.32's other vision encoders (CLIP, SigLIP, Pixtral, Qwen-VL)
import torchvision through ``models/vision.py``, and the CPU set-up removes
torchvision (reference/cpu-test-engine.md, workaround 1); BLIP-2's do not.

Unlike the text model (pure Python, so the base install can build it), this
is built by the engine's interpreter (``ENGINELINK_VLLM_PYTHON`` /
``ENGINELINK_VLLM_VENV`` / the checkout's ``.venv-vllm``), with torch and
transformers: a vision model is only of use where that engine is. Offline
(the tokenizer comes from the text test model, built first), deterministic
(seeded CPU init; two builds are byte-identical, ``tests/vllm/test_vllm_vision.py``),
atomic (a staging folder renamed into place, the marker last).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from enginelink.runtime.contracts.vllm.launch import default_vllm_python
from enginelink.tools import test_model

RECIPE_VERSION = 2  # 2: the chat template walks content parts (the router's "openai" content format)
MARKER_NAME = "ENGINELINK-TEST-VISION-MODEL"
IMAGE_TOKEN = "<image>"
NUM_QUERY_TOKENS = 4  # image tokens per image
IMAGE_SIZE = 56
BUILD_TIMEOUT_S = 600

# Run by the engine's interpreter: argv = text model dir, output dir.
BUILDER = r'''
import json, sys
from pathlib import Path
import torch
from transformers import (Blip2Config, Blip2ForConditionalGeneration, Blip2Processor, Blip2QFormerConfig,
                          Blip2VisionConfig, BlipImageProcessor, LlamaConfig, PreTrainedTokenizerFast)

text_dir, out, num_query, image_size, image_token = (Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]),
                                                      int(sys.argv[4]), sys.argv[5])
tok = PreTrainedTokenizerFast.from_pretrained(text_dir)
tok.add_special_tokens({"additional_special_tokens": [image_token]})
image_id = tok.convert_tokens_to_ids(image_token)
tc = json.loads((text_dir / "config.json").read_text())
text = LlamaConfig(**{k: v for k, v in tc.items() if k not in ("architectures", "model_type")})
text.vocab_size = tc["vocab_size"] + 256  # room for the image token, padded as checkpoints pad
vision = Blip2VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                           image_size=image_size, patch_size=14)
qformer = Blip2QFormerConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128,
                             encoder_hidden_size=64, vocab_size=64)
config = Blip2Config(vision_config=vision.to_dict(), qformer_config=qformer.to_dict(), text_config=text.to_dict(),
                     num_query_tokens=num_query, image_token_index=image_id)
torch.manual_seed(0)
model = Blip2ForConditionalGeneration(config).to(torch.bfloat16)
with torch.no_grad():
    # As the text model: weights large enough that greedy output depends on the input (here the image).
    for name, p in sorted(model.named_parameters()):
        if p.dim() > 1:
            p.normal_(0.0, 0.3)
model.save_pretrained(out)
# The text model's ChatML, walking content parts: a template that iterates message['content'] is the
# "openai" content format, for which the SMG router passes image parts to the template as {"type": "image"}
# and needs no placeholder string (a string-format template needs one, which BLIP-2's family has none of).
# Image parts render as nothing: BLIP-2's processor inserts its query tokens in front of the prompt.
template = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
            "{% if message['content'] is string %}{{ message['content'] }}"
            "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
            "{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>' + '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
tok.chat_template = template
processor = Blip2Processor(image_processor=BlipImageProcessor(size={"height": image_size, "width": image_size}),
                           tokenizer=tok, num_query_tokens=num_query, chat_template=template)
processor.save_pretrained(out)
print(image_id)
'''


def marker_text() -> str:
    return test_model.marker_text(RECIPE_VERSION)


def is_complete(model_dir: Path) -> bool:
    return test_model.is_complete(model_dir, MARKER_NAME, RECIPE_VERSION)


def make_vision_model(out_dir: Path, *, force: bool = False, python: str | None = None) -> Path:
    """Build the vision test model at ``out_dir`` (kept as it is when complete, unless ``force``)."""
    return build_staged(Path(out_dir), "vision", is_complete, MARKER_NAME, marker_text(),
                        [BUILDER, str(NUM_QUERY_TOKENS), str(IMAGE_SIZE), IMAGE_TOKEN], force=force, python=python)


def build_staged(out_dir: Path, kind: str, complete, marker_name: str, marker: str, builder: list[str], *,
                 force: bool, python: str | None) -> Path:
    """Build a media test model in a staging folder beside ``out_dir``, then swap it in whole.

    ``builder`` is the vLLM-venv script (``-c``) and its arguments after the text model's and the output's
    folders; ``complete(out_dir)`` says whether what is there is kept; ``marker`` is written last, in
    ``marker_name``: it certifies the rest (shared by the video and audio models, tools/test_media_models.py)."""
    if out_dir.exists():
        if complete(out_dir) and not force:
            return out_dir
        if not force and (not out_dir.is_dir() or any(out_dir.iterdir())):
            raise FileExistsError(f"{out_dir} exists and is not a complete {kind} test model; use --force")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.build-", dir=out_dir.parent))
    try:
        staging.chmod(0o755)
        text_dir = staging / "text"
        test_model.make_test_model(text_dir)
        model_dir = staging / "model"
        subprocess.run([python or default_vllm_python(), "-c", builder[0], str(text_dir), str(model_dir),
                        *builder[1:]], check=True, timeout=BUILD_TIMEOUT_S, capture_output=True)  # fmt: skip
        for path in model_dir.iterdir():
            path.chmod(0o644)  # save_pretrained leaves the weights 0600; a model dir is readable like any other
        (model_dir / marker_name).write_text(marker)  # last: it certifies the rest
        if out_dir.exists() or out_dir.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            out_dir.rename(old / "old")
            model_dir.rename(out_dir)
            shutil.rmtree(old)
        else:
            model_dir.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir
