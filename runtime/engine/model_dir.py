"""Facts of a Hugging Face model directory, read from its files (no engine).

GetModelInfo, the tokenizer used for stop strings and GetTokenizer all need the
same few facts of the served model: vocabulary size, context length, special
token ids, architecture, dtype and the generation config's sampling defaults.
They come from ``config.json`` and ``generation_config.json`` here, once, as a
frozen ``ModelFacts``.

Rules:

- Pure functions over files: no engine, no network, no caching, no clocks.
- A missing directory, a missing or unreadable ``config.json``, or a config
  that is not a JSON object is a ``ModelDirError`` naming the file and the
  problem. ``generation_config.json`` is optional, but a broken one is an error
  too: silently dropping a model's sampling defaults would change its output.
- Unknown numeric facts are 0 (the proto's "unset"); multimodal configs keep
  text facts under ``text_config``, consulted when the top level lacks them.
- ``eos_token_ids``: ``config.json``'s ids first, then the extras of
  ``generation_config.json``, deduplicated in that order (as the reference
  servicer does); either file may hold an int or a list.
- ``default_sampling_params``: the non-null ``temperature, top_p, top_k,
  min_p, repetition_penalty`` of the generation config, in that order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# Where configs keep the context length, most specific first.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


class ModelDirError(Exception):
    """The model directory or one of its files cannot be used (operator's fault)."""


class ModelFacts(msgspec.Struct, frozen=True, kw_only=True):
    model_path: str
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    architectures: tuple[str, ...]
    model_type: str
    dtype: str  # torch's name, e.g. "bfloat16"; "" when the config has none
    default_sampling_params: dict[str, float | int]
    tokenizer_path: str  # "" when the directory holds no tokenizer files
    # A vision tower in the config (``vision_config``): GetModelInfo's supports_vision.
    supports_vision: bool = False

    @property
    def default_sampling_params_json(self) -> str:
        """GetModelInfo's field: a JSON object, or "" when there are no defaults."""
        if not self.default_sampling_params:
            return ""
        return json.dumps(self.default_sampling_params, separators=(",", ":"))


def _read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if required:
            raise ModelDirError(f"{path}: missing") from None
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelDirError(f"{path}: unreadable ({exc})") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelDirError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelDirError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_ids(value: Any, path: Path, key: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    # bool is an int to Python, never a token id to a config.
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ModelDirError(f"{path}: {key} must be an int or a list of ints, got {value!r}")
    return values


def _lookup(config: dict[str, Any], *keys: str) -> Any:
    text_config = config.get("text_config")
    for scope in (config, text_config if isinstance(text_config, dict) else {}):
        for key in keys:
            if scope.get(key) is not None:
                return scope[key]
    return None


def _first_id(*candidates: Any) -> int | None:
    for value in candidates:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _count(value: Any, path: Path, key: str) -> int:
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ModelDirError(f"{path}: {key} must be a non-negative int, got {value!r}")
    return value


def read_model_facts(model_dir: str | Path) -> ModelFacts:
    """Read the facts of the model directory ``model_dir``."""
    root = Path(model_dir)
    if not root.is_dir():
        raise ModelDirError(
            f"{root}: not a directory" if root.exists() else f"{root}: no such directory"
        )
    config_path = root / "config.json"
    generation_path = root / "generation_config.json"
    config = _read_json(config_path, required=True)
    assert config is not None
    generation = _read_json(generation_path, required=False) or {}

    eos: list[int] = []
    for value in (
        *_token_ids(_lookup(config, "eos_token_id"), config_path, "eos_token_id"),
        *_token_ids(generation.get("eos_token_id"), generation_path, "eos_token_id"),
    ):
        if value not in eos:
            eos.append(value)

    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ModelDirError(
            f"{config_path}: architectures must be a list of strings, got {architectures!r}"
        )
    dtype = _lookup(config, "dtype", "torch_dtype") or ""

    return ModelFacts(
        model_path=str(root),
        vocab_size=_count(_lookup(config, "vocab_size"), config_path, "vocab_size"),
        max_position_embeddings=_count(
            _lookup(config, *CONTEXT_KEYS), config_path, "max_position_embeddings"
        ),
        eos_token_ids=tuple(eos),
        bos_token_id=_first_id(_lookup(config, "bos_token_id"), generation.get("bos_token_id")),
        pad_token_id=_first_id(_lookup(config, "pad_token_id"), generation.get("pad_token_id")),
        architectures=tuple(architectures),
        supports_vision=isinstance(config.get("vision_config"), dict),
        model_type=str(config.get("model_type") or ""),
        dtype=str(dtype),
        default_sampling_params={
            k: generation[k] for k in SAMPLING_KEYS if generation.get(k) is not None
        },
        tokenizer_path=(
            str(root) if any((root / name).is_file() for name in TOKENIZER_FILES) else ""
        ),
    )


def load_tokenizer(path: str | Path):
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` or a directory holding one."""
    from tokenizers import Tokenizer  # the Rust extension loads only when a tokenizer is needed

    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise ModelDirError(f"{file}: missing (only tokenizer.json tokenizers are supported)")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises plain Exception for a bad file
        raise ModelDirError(f"{file}: not a loadable tokenizer ({exc})") from exc
