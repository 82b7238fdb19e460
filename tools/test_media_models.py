"""``enginelink make-test-model --video DIR`` / ``--audio DIR``: tiny video and audio models vLLM 0.32 runs on CPU.

The smallest vLLM-supported architectures that transformers itself builds,
on the text test model's Llama-sized shape and tokenizer, random weights,
with the model family's own processor saved beside them:

- **video: Qwen3-VL** (``Qwen3VLForConditionalGeneration``): a 2-layer ViT
  (16 px patches, 2 frames a temporal patch, 2x2 merged, a 16x16 learned
  position grid, both layers' deepstack features fed to the text side),
  Qwen3's text layers (q/k norms, interleaved M-RoPE); it takes images and
  videos. Why Qwen3-VL: the SMG router 1.13.0 takes video for this family
  only (its ``qwen3_vl`` spec, chosen by ``model_type``; the ``qwen_vl``
  spec, Qwen2-VL's, refuses a video chat), so one video model serves both
  the direct and the router cases. Its processors are sized to 64x64 frames
  (a 56 px clip is rounded up to 4x4 patches: 4 tokens a temporal patch);
  the video processor samples at 2 fps, as vLLM's loader for it does
  (``get_video_loader_backend_for_processor``), and vLLM's processor puts a
  ``<t seconds>`` timestamp before each temporal patch. Needs the video
  processor's torchvision (``tools/setup-vllm-media``).
- **audio: Qwen2-Audio** (``Qwen2AudioForConditionalGeneration``): a 2-layer
  Whisper-style encoder (128 mel bins, 30 s windows, as vLLM's processor
  requires), a linear projector; ``WhisperFeatureExtractor`` at 16 kHz.
  transformers 5 writes the text model's keys one ``model.`` too deep for
  this family's checkpoint layout; they are written back as the released
  checkpoints have them (``language_model.model.*``), which vLLM loads.

Chat templates walk content parts (the router's "openai" content format)
and place each family's own placeholder (``<|vision_start|><|video_pad|>
<|vision_end|>``, ``<|audio_bos|><|AUDIO|><|audio_eos|>``), which vLLM's
processor expands. Built by the engine's interpreter as the vision model is
(``tools/test_vision_model.py``): offline, deterministic (seeded; two builds
byte-identical), atomic (a staging folder renamed into place, the marker last).
"""

from __future__ import annotations

from pathlib import Path

from enginelink.tools import test_model
from enginelink.tools.test_vision_model import build_staged

# Per kind: bump when any output byte of that kind changes, so old builds stop counting as complete.
RECIPE_VERSIONS = {"video": 2, "audio": 1}  # video 2: Qwen3-VL (1 was Qwen2-VL)
MARKERS = {"video": "ENGINELINK-TEST-VIDEO-MODEL", "audio": "ENGINELINK-TEST-AUDIO-MODEL"}
# The ids the added special tokens get (after the text model's 4096): the tests build prompts with them.
VIDEO_TOKENS = {"<|vision_start|>": 4096, "<|vision_end|>": 4097, "<|image_pad|>": 4098, "<|video_pad|>": 4099}
AUDIO_TOKENS = {"<|audio_bos|>": 4096, "<|AUDIO|>": 4097, "<|audio_eos|>": 4098}

_COMMON = r'''
import json, sys
from pathlib import Path
import torch
from transformers import PreTrainedTokenizerFast

text_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
tok = PreTrainedTokenizerFast.from_pretrained(text_dir)
tc = json.loads((text_dir / "config.json").read_text())
# The text side: the text test model's shape; the vocabulary padded for the added tokens, as checkpoints pad.
TEXT = dict(vocab_size=tc["vocab_size"] + 256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
            bos_token_id=0, eos_token_id=2, pad_token_id=0)


def specials(names):
    tok.add_special_tokens({"additional_special_tokens": list(names)})
    return {name: tok.convert_tokens_to_ids(name) for name in names}


def randomize(model):
    # As the text model: weights large enough that greedy output depends on the input (here the media).
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() > 1:
                p.normal_(0.0, 0.3)


def template(parts):
    """ChatML walking content parts; ``parts``: {part type: the placeholder text it renders}."""
    cases = "".join("{% elif part['type'] in " + repr(tuple(types)) + " %}{{ '" + text + "' }}"
                    for types, text in parts)
    return ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
            "{% if message['content'] is string %}{{ message['content'] }}"
            "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
            + cases + "{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>' + '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
'''

VIDEO_BUILDER = _COMMON + r'''
from transformers import (Qwen2VLImageProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor,
                          Qwen3VLVideoProcessor)

ids = specials(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
# Qwen3's M-RoPE: the released models' sections ([24, 20, 20] of a 128-wide head) halved for the 64-wide head.
text = dict(TEXT, head_dim=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "mrope_section": [12, 10, 10], "mrope_interleaved": True})
vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=16, spatial_merge_size=2,
              temporal_patch_size=2, out_hidden_size=TEXT["hidden_size"], num_position_embeddings=256,
              deepstack_visual_indexes=[0, 1])
config = Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                       video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                       vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True)
torch.manual_seed(0)
model = Qwen3VLForConditionalGeneration(config).to(torch.bfloat16)
randomize(model)
model.save_pretrained(out)
chat = template([(("image", "image_url"), "<|vision_start|><|image_pad|><|vision_end|>"),
                 (("video", "video_url"), "<|vision_start|><|video_pad|><|vision_end|>")])
tok.chat_template = chat
side = 64  # patch 16 x merge 2: one merged token per 32x32
half = dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])  # the family's normalization
# cap_pixels_per_frame stated (off: transformers' current behaviour); unset, the processor warns that it changes.
processor = Qwen3VLProcessor(
    image_processor=Qwen2VLImageProcessor(patch_size=16, merge_size=2, min_pixels=side * side,
                                          max_pixels=4 * side * side, **half),
    video_processor=Qwen3VLVideoProcessor(size={"shortest_edge": side * side, "longest_edge": 8 * side * side},
                                          patch_size=16, merge_size=2, temporal_patch_size=2, fps=2.0,
                                          cap_pixels_per_frame=False, **half),
    tokenizer=tok, chat_template=chat)
processor.save_pretrained(out)
print(json.dumps(ids))
'''

AUDIO_BUILDER = _COMMON + r'''
from safetensors.torch import load_file, save_file
from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration, Qwen2AudioProcessor, WhisperFeatureExtractor

ids = specials(["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"])
audio = dict(model_type="qwen2_audio_encoder", num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2,
             encoder_ffn_dim=128, d_model=64, max_source_positions=1500)
config = Qwen2AudioConfig(audio_config=audio, text_config=dict(TEXT, model_type="qwen2", tie_word_embeddings=True),
                          audio_token_index=ids["<|AUDIO|>"])
torch.manual_seed(0)
model = Qwen2AudioForConditionalGeneration(config).to(torch.bfloat16)
randomize(model)
model.save_pretrained(out)
weights = load_file(out / "model.safetensors")
save_file({k.replace("language_model.model.model.", "language_model.model.", 1): v for k, v in sorted(weights.items())},
          out / "model.safetensors", metadata={"format": "pt"})
chat = template([(("audio", "audio_url", "input_audio"), "<|audio_bos|><|AUDIO|><|audio_eos|>")])
tok.chat_template = chat
processor = Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=128), tokenizer=tok,
                                chat_template=chat)
processor.save_pretrained(out)
print(json.dumps(ids))
'''

BUILDERS = {"video": VIDEO_BUILDER, "audio": AUDIO_BUILDER}


def is_complete(model_dir: Path, kind: str) -> bool:
    return test_model.is_complete(model_dir, MARKERS[kind], RECIPE_VERSIONS[kind])


def make_media_model(kind: str, out_dir: Path, *, force: bool = False, python: str | None = None) -> Path:
    """Build the ``kind`` ("video" or "audio") test model at ``out_dir`` (kept as it is when complete)."""
    return build_staged(Path(out_dir), kind, lambda path: is_complete(path, kind), MARKERS[kind],
                        test_model.marker_text(RECIPE_VERSIONS[kind]), [BUILDERS[kind]], force=force, python=python)
