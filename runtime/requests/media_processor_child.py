"""The media processor helper: the model's own vLLM multimodal processor, in the vLLM venv.

Run BY PATH with the vLLM venv's python (enginelink is not installed there,
and enginelink's venv has no torch):

    ENGINELINK_MM_ENGINE_ARGS='[...]' VENV/bin/python media_processor_child.py --model DIR [--max-video-frames N]

Why a process of its own (docs/limits.md, "Media processor"): vLLM 0.32's
engine core takes only processed ``mm_features`` (tensors, placeholder
ranges, hashes); turning an image, a video or an audio clip into them is the
front end's job (``vllm/renderers/base.py`` ``_process_multimodal``), which
needs torch, transformers and the model's HF processors. This helper does
exactly that front-end step and nothing else, with vLLM's own code:

- the model config is the engine's (below): its ``--limit-mm-per-prompt``,
  ``--media-io-kwargs``, ``--mm-processor-kwargs``, ``--max-model-len``, ...;
- the bytes are decoded by vLLM's own loaders as ``vllm serve`` builds them
  for a URL (``MediaConnector.fetch_*``): ``ImageMediaIO`` (RGB unless the
  media kwargs say otherwise), ``VideoMediaIO`` (the video backend the
  model's video processor asks for, else ``VLLM_VIDEO_LOADER_BACKEND``),
  ``AudioMediaIO``, each with the engine's ``--media-io-kwargs``; a video's
  frame count is capped at ``--max-video-frames`` (``SMG_VLLM_MM_MAX_VIDEO_FRAMES``,
  0: vLLM decides), never raised past what the loader would sample;
- ``MULTIMODAL_REGISTRY.create_processor(model_config).apply(...)`` runs the
  HF processor and expands the placeholders in the tokenized prompt (the
  per-modality item limits are checked there, in vLLM's words);
- each item becomes a ``MultiModalFeatureSpec`` in prompt order (as
  ``InputProcessor.process_inputs`` builds them, identifier = content hash,
  no LoRA), encoded by vLLM's own ``MsgpackEncoder`` with every tensor inline;
  beside them each item's feature (embedding) tokens, which the servicer
  holds to the engine's encoder budget, and the request's media identity
  (hashes, placeholders, grid tensors: what a PD decode side needs).

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
  → ``{"id", "prompt": [expanded ids], "features": [specs], "embeds":
  [[modality, index in its modality, feature tokens]], "identity": [per
  modality]}`` or ``{"id", "error", "fault": "client"|"internal", "item": index|None}``.
One request at a time (the processor is CPU-bound; the caller serializes).
EOF on stdin ends the helper, so it never outlives enginelink.

Rules: imports nothing of enginelink; only the standard library at module
level, vLLM, torch and PIL inside ``main``.
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


# The per-item tensors a PD decode side needs besides pixels, to place the media and hash its blocks: the
# M-RoPE grids and the video timing that goes with them, in the spellings vLLM's processors use.
GRID_KEYS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts", "video_second_per_grid")


def capped_video_kwargs(video: dict, max_frames: int, loader_default: int | None) -> dict:
    """The engine's video media kwargs with the sampled frames capped at ``max_frames`` (0: left as they are).

    vLLM's loaders sample either a count (``num_frames``: the generic OpenCV loader) or by fps up to a
    maximum (``max_frames``: Qwen2-VL's and Qwen3-VL's); both are capped. A cap never raises sampling: each
    is the kwargs' own, else the loader's default (unknown and unset: only ``max_frames`` is set, which can
    only lower it). A count <= 0 means every frame to vLLM's loader, so it is capped as well."""
    if max_frames <= 0:
        return video
    out = dict(video)
    current = video.get("num_frames", loader_default)
    if current is not None:
        out["num_frames"] = max_frames if int(current) <= 0 else min(int(current), max_frames)
    ceiling = video.get("max_frames")
    out["max_frames"] = max_frames if ceiling is None or int(ceiling) <= 0 else min(int(ceiling), max_frames)
    return out


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--model", required=True)
    args.add_argument("--max-model-len", type=int, default=None)
    args.add_argument("--max-video-frames", type=int, default=0)
    opts = args.parse_args(argv)
    # Frames only on the real stdout: anything vLLM or transformers prints goes to stderr.
    frames_out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    frames_in = sys.stdin.buffer

    import inspect

    import msgspec
    import PIL.Image
    import torch
    import vllm
    from vllm.config import ModelConfig
    from vllm.exceptions import VLLMClientError
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.multimodal.media import AudioMediaIO, ImageMediaIO, VideoMediaIO
    from vllm.multimodal.processing.context import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs
    from vllm.multimodal.video import get_video_loader_backend_for_processor
    from vllm.transformers_utils.processor import get_video_processor_cls_name
    from vllm.v1.serial_utils import MsgpackEncoder

    # A decompression bomb (a few KiB of PNG that decode to gigapixels) is the caller's fault, not a crash.
    warnings.simplefilter("error", PIL.Image.DecompressionBombWarning)
    model_config = _model_config(opts.model, opts.max_model_len, ModelConfig)
    processor = MULTIMODAL_REGISTRY.create_processor(model_config)
    io_kwargs = dict(getattr(model_config.get_multimodal_config(), "media_io_kwargs", None) or {})
    # As vLLM's MediaConnector builds its loaders for a URL (fetch_image / fetch_video / fetch_audio).
    image_io = ImageMediaIO(**({"image_mode": "RGB"} | dict(io_kwargs.get("image") or {})))
    video_kwargs = dict(io_kwargs.get("video") or {})
    default_frames = inspect.signature(VideoMediaIO.__init__).parameters["num_frames"].default
    video_kwargs = capped_video_kwargs(video_kwargs, opts.max_video_frames,
                                       default_frames if isinstance(default_frames, int) else None)
    loaders = {"image": lambda: image_io, "audio": lambda: AudioMediaIO(**dict(io_kwargs.get("audio") or {}))}
    if processor.info.supported_mm_limits.get("video", 0) != 0:
        backend = get_video_loader_backend_for_processor(get_video_processor_cls_name(model_config))
        loaders["video"] = lambda: VideoMediaIO(image_io, **({"video_backend": backend} if backend and
                                                            "video_backend" not in video_kwargs else {}),
                                                **video_kwargs)  # fmt: skip
    encoder = MsgpackEncoder(size_threshold=1 << 62)  # every tensor inline (ext 3), as the engine's decoder takes it
    decoder = msgspec.msgpack.Decoder()
    write_frame(frames_out, encoder.encode({"ready": True, "version": vllm.__version__,
                                            "fingerprint": fingerprint(model_config)})[0])

    def load(modality: str, data: bytes):
        loader = loaders.get(modality)
        if loader is None:
            raise _Refused(f"this model takes no {modality} input")
        try:
            return loader().load_bytes(data)
        except Exception as error:  # each decoder raises its own types; each is this item's bytes' fault
            raise _Refused(f"not a decodable {modality}: {type(error).__name__}: {error}"[:300]) from None

    def process(request: dict) -> dict:
        media: dict[str, list] = {}
        for index, item in enumerate(request["items"]):
            try:
                media.setdefault(item["modality"], []).append(load(item["modality"], item["data"]))
            except _Refused as refused:
                return {"error": str(refused), "fault": "client", "item": index}
        try:
            items = processor.info.parse_mm_data(media)
            result = processor.apply(ProcessorInputs(list(request["prompt"]), items), TimingContext(enabled=False))
        except (VLLMClientError, ValueError) as error:  # vLLM's words for "this input does not fit this model"
            return {"error": str(error)[:500], "fault": "client", "item": None}
        prompt = list(result["prompt_token_ids"])
        features, embeds = [], []
        for modality, placeholders in result["mm_placeholders"].items():
            for index, position in enumerate(placeholders):
                mm_hash = result["mm_hashes"][modality][index]
                features.append(MultiModalFeatureSpec(data=result["mm_kwargs"][modality][index], modality=modality,
                                                      identifier=mm_hash, mm_position=position, mm_hash=mm_hash))
                embeds.append([modality, index, int(position.get_num_embeds())])
        features.sort(key=lambda f: f.mm_position.offset)
        return {"prompt": prompt, "features": features, "embeds": embeds, "identity": identity(result, prompt)}

    def identity(result, prompt: list[int]) -> list[dict] | None:
        """Per modality: hashes, placeholders, the embed token, grid tensors (one row per item), or None when
        a grid is not one row per item (the decode side then processes the media itself)."""
        out = []
        for modality, hashes in result["mm_hashes"].items():
            ranges = list(result["mm_placeholders"].get(modality) or [])
            items = list(result["mm_kwargs"].get(modality) or [])
            entry = {"modality": modality, "hashes": list(hashes),
                     "placeholders": [[int(r.offset), int(r.length)] for r in ranges],
                     "im_token_id": embed_token(prompt, ranges), "tensors": {}, "keep_on_cpu": []}  # fmt: skip
            for key in GRID_KEYS:
                elems = [item[key] for item in items if key in item]
                if not elems:
                    continue
                rows = [torch.as_tensor(elem.data) for elem in elems]
                if len(rows) != len(items) or any(row.shape != rows[0].shape for row in rows):
                    return None
                stacked = torch.stack(rows).contiguous()
                if stacked.dtype not in (torch.int64, torch.float32):
                    stacked = stacked.to(torch.float32 if stacked.is_floating_point() else torch.int64)
                name = "int64" if stacked.dtype == torch.int64 else "float32"
                entry["tensors"][key] = [name, list(stacked.shape), stacked.numpy().tobytes()]
                if any(getattr(elem.field, "keep_on_cpu", False) for elem in elems):
                    entry["keep_on_cpu"].append(key)
            out.append(entry)
        return out

    def embed_token(prompt: list[int], ranges) -> int | None:
        """The token the embeddings land on, where a placeholder mixes it with others (its is_embed mask)."""
        for r in ranges:
            if r.is_embed is None:
                continue
            mask = torch.as_tensor(r.is_embed).flatten().bool()
            if bool(mask.any()) and not bool(mask.all()):
                return int(prompt[r.offset + int(mask.nonzero()[0])])
        return None

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
    # parse_known_args: a flag of vllm serve's front end among them (--api-key, ...) is not the model's.
    args, _unknown = parser.parse_known_args(["--model", model, *([] if max_model_len is None else
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


class _Refused(Exception):
    """An item the client sent that this model or its decoders cannot take."""


if __name__ == "__main__":
    sys.exit(main())
