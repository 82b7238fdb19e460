"""Where the served model comes from: a local directory, or a Hugging Face Hub id resolved as vLLM resolves it.

Every reference example names its model by Hub id (``Qwen/Qwen3-0.6B``). The
servicer reads the model's own files (config, generation config, tokenizer:
``model_dir.py``), so an id is resolved here, once, before anything starts,
through ``huggingface_hub`` and the same settings vLLM 0.32 honours
(``vllm/engine/arg_utils.py``, ``vllm/transformers_utils/repo_utils.py``):

- a name that exists on disk is a local directory, whatever it looks like
  (vLLM: ``os.path.exists``); anything else must be a valid repo id;
- ``revision`` (``--revision``; default ``main``), the cache (``--download-dir``,
  else ``HF_HUB_CACHE`` / ``HF_HOME``, which huggingface_hub reads),
  ``HF_HUB_OFFLINE`` (no request at all: the cache only) and the token
  (``--hf-token`` among vLLM's engine arguments, else ``HF_TOKEN`` or the
  stored login, which huggingface_hub reads itself; never logged, never on a
  command line);
- what is fetched: the files the servicer reads, i.e. everything but the
  weights and large assets, which is what vLLM's own front end fetches for
  its tokenizer and processor (``get_non_weight_snapshot_path``); for the MLX
  engine (enginelink's, which loads the snapshot it is given) mlx-lm's own
  file set, weights included.

What the engine is given (``ModelSource.for_engine``), as vLLM does it: an
engine that resolves ids itself (vLLM, SGLang, TokenSpeed) gets the id while
the Hub is reachable, so it downloads exactly the weights its load format
reads (safetensors over bin, GGUF, …) with its own rules; offline it gets the
local snapshot, which is what vLLM's ``EngineArgs`` rewrites an id to under
``HF_HUB_OFFLINE`` (from the same cache the servicer read, ``--download-dir``
included, which vLLM's own rewrite does not consult). The sim and MLX
engines always get the local snapshot.

Errors are ``ModelSourceError`` (the operator's: ``serve`` exits 2), naming
the id, its revision and cache, and how to fetch it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# vLLM 0.32's ``_WEIGHT_FILE_PATTERNS`` (repo_utils.py): what its front end does not fetch for a
# tokenizer or processor. The servicer needs no more than that front end.
NON_WEIGHT_IGNORE = (
    "*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.h5", "*.msgpack", "*.onnx", "*.onnx_data",
    "*.png", "*.jpg", "*.jpeg", "*.gif", "*.webp", "*.mp3", "*.mp4", "*.wav", "*.flac", "*.parquet", "*.arrow",
    "*.ipynb", "*.zip", "*.tar*",
)  # fmt: skip
# mlx-lm's ``_download`` allow-list (mlx_lm/utils.py): the files ``mlx_lm.load`` reads, weights included.
MLX_LM_FILES = ("*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt",
                "*.jsonl", "*.jinja")  # fmt: skip
# Engines that take a Hub id themselves: the id goes to them while the Hub is reachable.
ID_ENGINES = ("vllm", "sglang", "tokenspeed")
# Each engine's spelling of the settings enginelink's own flags stand for (``engine_flags``). TokenSpeed runs
# with --skip-tokenizer-init (its tokenizer flag would change nothing); SGLang's scheduler keeps its tokenizer
# (its grammar backend is built from it: contracts/sglang/launch.py).
ENGINE_FLAGS = {
    "vllm": {"revision": "--revision", "download_dir": "--download-dir", "tokenizer": "--tokenizer",
             "tokenizer_revision": "--tokenizer-revision", "token": "--hf-token"},
    "sglang": {"revision": "--revision", "download_dir": "--download-dir", "tokenizer": "--tokenizer-path"},
    "tokenspeed": {"revision": "--revision", "download_dir": "--download-dir"},
}


class ModelSourceError(Exception):
    """The model cannot be found or fetched as configured (operator's fault); the message says what to do."""


@dataclass(frozen=True)
class ModelSource:
    """A model, resolved to a local directory the servicer reads."""

    given: str  # what the operator named: a directory or a Hub id
    local_dir: Path  # the directory, or the Hub snapshot
    repo_id: str | None = None  # the Hub id, when it was one
    revision: str | None = None  # the revision asked for (None: main)
    commit: str | None = None  # the snapshot's commit
    offline: bool = False  # HF_HUB_OFFLINE when it was resolved

    def for_engine(self, engine: str) -> str:
        """The model argument ``engine`` is launched with (the module's header says why)."""
        if self.repo_id is not None and engine in ID_ENGINES and not self.offline:
            return self.repo_id
        return str(self.local_dir)

    @property
    def name(self) -> str:
        """The model's name where one is shown: the Hub id, else the directory (GetModelInfo's model_path)."""
        return self.repo_id or str(self.local_dir)


def offline() -> bool:
    from huggingface_hub import constants

    check = getattr(constants, "is_offline_mode", None)  # huggingface_hub >= 1.0; before, the constant
    return bool(check() if check is not None else constants.HF_HUB_OFFLINE)


def cache_dir(download_dir: str | None) -> str:
    from huggingface_hub import constants

    return str(Path(download_dir or constants.HF_HUB_CACHE).expanduser())


def resolve_model(name: str | Path, *, revision: str | None = None, download_dir: str | None = None,
                  token: str | None = None, mlx: bool = False) -> ModelSource:
    """``name`` as a local directory, or its Hub snapshot (fetched unless offline); ``ModelSourceError``."""
    given = str(name)
    path = Path(given).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelSourceError(f"{given}: not a directory")
        return ModelSource(given=given, local_dir=path)
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(given)
    except HFValidationError:
        raise ModelSourceError(f"{given}: no such directory (nor a Hugging Face model id, ORG/NAME)") from None
    return _from_hub(given, revision, download_dir, token, mlx)


def _from_hub(repo_id: str, revision: str | None, download_dir: str | None, token: str | None,
              mlx: bool) -> ModelSource:
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import (
        GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError,
    )  # fmt: skip

    is_offline, cache = offline(), cache_dir(download_dir)
    asked = f"{repo_id!r} (revision {revision or 'main'})"
    try:
        snapshot = snapshot_download(
            repo_id, revision=revision, cache_dir=download_dir, token=token,
            allow_patterns=list(MLX_LM_FILES) if mlx else None,
            ignore_patterns=None if mlx else list(NON_WEIGHT_IGNORE),
        )  # fmt: skip
    except RevisionNotFoundError:
        raise ModelSourceError(f"model {asked}: the Hub has no such revision (--revision)") from None
    except (RepositoryNotFoundError, GatedRepoError):
        raise ModelSourceError(f"model {asked}: not on the Hugging Face Hub, or not readable without a token "
                               "(HF_TOKEN, or vLLM's --hf-token); no such local directory either") from None
    except LocalEntryNotFoundError:
        fetch = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "") + \
            (f" --cache-dir {cache}" if download_dir else "")
        why = ("HF_HUB_OFFLINE is set: nothing is downloaded" if is_offline
               else "and the Hugging Face Hub could not be reached")
        raise ModelSourceError(
            f"model {asked} is not a local directory and not in the Hugging Face cache at {cache} ({why}); "
            f"fetch it where the Hub is reachable with `{fetch}` into the cache this servicer reads "
            "(--download-dir, HF_HUB_CACHE or HF_HOME), or pass a local directory") from None
    except HfHubHTTPError as error:
        raise ModelSourceError(f"model {asked}: the Hugging Face Hub answered {error}") from None
    except (OSError, ValueError) as error:
        raise ModelSourceError(f"model {asked}: cannot use the Hugging Face cache at {cache} ({error})") from None
    local = Path(snapshot)
    source = ModelSource(given=repo_id, local_dir=local, repo_id=repo_id, revision=revision, commit=local.name,
                         offline=is_offline)  # fmt: skip
    log.info("model %s: snapshot %s at %s (%s)", asked, local.name, local,
             "offline, from the cache" if is_offline else "the Hub's, non-weight files fetched" if not mlx
             else "the Hub's, mlx-lm's files fetched")
    return source


def engine_flags(engine: str, engine_args: list[str], settings: dict[str, str | None]) -> list[str]:
    """Engine arguments for enginelink's own ``settings`` (revision, download_dir, tokenizer) that the
    engine's arguments do not already give, in ``engine``'s spelling; nothing for an engine without one."""
    from enginelink.runtime.engine.launchers import flag_value

    spelled = ENGINE_FLAGS.get(engine, {})
    out: list[str] = []
    for setting, value in settings.items():
        flag = spelled.get(setting)
        if value is None or flag is None:
            continue
        if flag_value(engine_args, flag) is None and flag not in engine_args:
            out += [flag, value]
    return out


def engine_setting(engine: str, engine_args: list[str], setting: str) -> str | None:
    """The value of ``setting`` among ``engine``'s own arguments (``vllm serve ID --revision R``), if given."""
    from enginelink.runtime.engine.launchers import flag_value

    flag = ENGINE_FLAGS.get(engine, {}).get(setting)
    return flag_value(engine_args, flag) if flag else None
