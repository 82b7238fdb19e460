"""The media processor helper: the model's own vLLM multimodal processor, in the vLLM venv.

Run BY PATH with the vLLM venv's python (enginelink is not installed there,
and enginelink's venv has no torch):

    VENV/bin/python media_processor_child.py --model DIR

Why a process of its own (docs/limits.md, "Media processor"): vLLM 0.32's
engine core takes only processed ``mm_features`` (tensors, placeholder
ranges, hashes); turning an image into them is the front end's job
(``vllm/renderers/base.py`` ``_process_multimodal``), which needs torch,
transformers and the model's HF image processor. This helper does exactly
that front-end step and nothing else, with vLLM's own code:

- the image bytes are decoded by vLLM's ``ImageMediaIO`` (RGB, as ``vllm
  serve`` loads an image URL);
- ``MULTIMODAL_REGISTRY.create_processor(model_config).apply(...)`` runs the
  HF processor and expands the placeholders in the tokenized prompt;
- each item becomes a ``MultiModalFeatureSpec`` in prompt order (as
  ``InputProcessor.process_inputs`` builds them, identifier = content hash,
  no LoRA), encoded by vLLM's own ``MsgpackEncoder`` with every tensor inline.

The model's config is the engine's: built from the engine's own arguments
(``ENGINELINK_MM_ENGINE_ARGS``, a JSON list, given by the servicer or the
media sidecar; read from the environment so that a secret among them never
shows in a process list) with vLLM's own parser, as the engine builds it.

Wire (stdin → stdout; stdout is kept for frames only, vLLM's logging goes to
stderr): frames of a 4-byte big-endian length and a msgpack map.
- first, unasked: ``{"ready": true, "version": vllm.__version__, "fingerprint": {...}}``,
  the fingerprint being what a Redis media sidecar and its worker must agree
  on (``wire/mm_sidecar.py``): the same derivation on both sides;
- then per request ``{"id", "prompt": [ids], "items": [{"modality", "data"}]}``
  → ``{"id", "prompt": [expanded ids], "features": [specs]}`` or
  ``{"id", "error", "fault": "client"|"internal", "item": index|None}``.
One request at a time (the processor is CPU-bound; the caller serializes).
EOF on stdin ends the helper, so it never outlives enginelink.

Rules: imports nothing of enginelink; only the standard library at module
level, vLLM and PIL inside ``main``.
"""

from __future__ import annotations

import argparse
import io
import os
import struct
import sys
import warnings

HEADER = struct.Struct(">I")
ENGINE_ARGS_ENV = "ENGINELINK_MM_ENGINE_ARGS"
# A modality vLLM never configures: its limit is the one every unconfigured modality gets.
UNSET_MODALITY = "__unset__"


def read_frame(stream) -> bytes | None:
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (size,) = HEADER.unpack(head)
    body = stream.read(size)
    return body if len(body) == size else None


def write_frame(stream, body: bytes) -> None:
    stream.write(HEADER.pack(len(body)) + body)
    stream.flush()


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--model", required=True)
    args.add_argument("--max-model-len", type=int, default=None)
    opts = args.parse_args(argv)
    # Frames only on the real stdout: anything vLLM or transformers prints goes to stderr.
    frames_out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    frames_in = sys.stdin.buffer

    import msgspec
    import PIL.Image
    import vllm
    from vllm.config import ModelConfig
    from vllm.exceptions import VLLMClientError
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.multimodal.media import ImageMediaIO
    from vllm.multimodal.processing.context import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs
    from vllm.v1.serial_utils import MsgpackEncoder

    # A decompression bomb (a few KiB of PNG that decode to gigapixels) is the caller's fault, not a crash.
    warnings.simplefilter("error", PIL.Image.DecompressionBombWarning)
    model_config = _model_config(opts.model, opts.max_model_len, ModelConfig)
    processor = MULTIMODAL_REGISTRY.create_processor(model_config)
    loader = ImageMediaIO(image_mode="RGB")
    encoder = MsgpackEncoder(size_threshold=1 << 62)  # every tensor inline (ext 3), as the engine's decoder takes it
    decoder = msgspec.msgpack.Decoder()
    write_frame(frames_out, encoder.encode({"ready": True, "version": vllm.__version__,
                                            "fingerprint": fingerprint(model_config)})[0])

    def process(request: dict) -> dict:
        images = []
        for index, item in enumerate(request["items"]):
            if item["modality"] != "image":
                return {"error": f"modality {item['modality']} is not processed by this worker (images only)",
                        "fault": "client", "item": index}  # fmt: skip
            try:
                images.append(loader.load_bytes(item["data"]))
            except Exception as error:  # PIL's errors are many types; each is this item's bytes' fault
                return {"error": f"not a decodable image: {type(error).__name__}: {error}"[:300],
                        "fault": "client", "item": index}  # fmt: skip
        try:
            items = processor.info.parse_mm_data({"image": images})
            result = processor.apply(ProcessorInputs(list(request["prompt"]), items), TimingContext(enabled=False))
        except (VLLMClientError, ValueError) as error:  # vLLM's words for "this input does not fit this model"
            return {"error": str(error)[:500], "fault": "client", "item": None}
        features = []
        for modality, placeholders in result["mm_placeholders"].items():
            for index, position in enumerate(placeholders):
                mm_hash = result["mm_hashes"][modality][index]
                features.append(MultiModalFeatureSpec(data=result["mm_kwargs"][modality][index], modality=modality,
                                                      identifier=mm_hash, mm_position=position, mm_hash=mm_hash))
        features.sort(key=lambda f: f.mm_position.offset)
        return {"prompt": list(result["prompt_token_ids"]), "features": features}

    while True:
        body = read_frame(frames_in)
        if body is None:
            return 0
        request = decoder.decode(body)
        try:
            reply = process(request)
        except Exception as error:  # our bug or vLLM's: the caller answers INTERNAL for this request only
            reply = {"error": f"{type(error).__name__}: {error}"[:500], "fault": "internal", "item": None}
        reply["id"] = request["id"]
        write_frame(frames_out, b"".join(bytes(part) for part in encoder.encode(reply)))


def _model_config(model: str, max_model_len: int | None, model_config_cls):
    """The engine's model config: its own arguments through vLLM's own parser, else the model's defaults."""
    import json

    words = json.loads(os.environ.get(ENGINE_ARGS_ENV) or "null")
    if words is None:
        return model_config_cls(model=model, max_model_len=max_model_len)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser(prog="enginelink media processor"))
    args = parser.parse_args(["--model", model, *([] if max_model_len is None else
                                                 ["--max-model-len", str(max_model_len)]), *words])
    config = AsyncEngineArgs.from_cli_args(args).create_model_config()
    config.quantization = None  # preprocessing only: no kernels
    return config


def fingerprint(model_config) -> dict[str, str]:
    """What a worker and its media sidecar must agree on, each a string; kwargs and limits as sorted JSON,
    the limits per modality as vLLM resolved them (so equivalent spellings of --limit-mm-per-prompt match)."""
    import dataclasses
    import json

    import vllm
    from vllm import envs

    mm = getattr(model_config, "multimodal_config", None)

    def canon(value) -> str:
        return json.dumps(value, sort_keys=True, default=str)

    limits: dict = {}
    if mm is not None:
        unset = {"count": mm.get_limit_per_prompt(UNSET_MODALITY)}
        limits["*"] = unset
        for modality in sorted(mm.limit_per_prompt or {}):
            options = mm.limit_per_prompt[modality]
            given = dataclasses.asdict(options) if dataclasses.is_dataclass(options) else \
                dict(options) if isinstance(options, dict) else {"count": options}
            entry = {"count": mm.get_limit_per_prompt(modality),
                     **{key: value for key, value in given.items() if key != "count" and value is not None}}
            if entry != unset:
                limits[modality] = entry
    processor_kwargs = getattr(mm, "mm_processor_kwargs", None)
    return {
        "model": str(model_config.model),
        "vllm_version": vllm.__version__,
        "dtype": str(model_config.dtype),
        "video_backend": str(envs.VLLM_VIDEO_LOADER_BACKEND),
        "media_io_kwargs": canon(dict(getattr(mm, "media_io_kwargs", None) or {})),
        "mm_processor_kwargs": canon(dict(processor_kwargs) if isinstance(processor_kwargs, dict) else {}),
        "limit_per_prompt": canon(limits),
    }


if __name__ == "__main__":
    sys.exit(main())
