"""The GetTokenizer payload: one deterministic ZIP of a tokenizer directory, in chunks.

smg-contract.md §9: the router asks GetTokenizer only as a fallback, verifies
the sha256 of the whole ZIP and extracts it to a temporary directory. This
module builds that ZIP and cuts it into ``GetTokenizerChunk`` payloads.

Rules:

- Only tokenizer files: the names in ``BUNDLE_FILES`` plus the top-level
  matches of ``BUNDLE_GLOBS``; never weights, never subdirectories. Symlinks
  are followed (Hugging Face cache snapshots are symlinks into blobs).
- Deterministic: sorted names, a fixed timestamp, fixed permissions and
  system, one compression level. Same files in, same bytes out.
- Chunks hold at most ``CHUNK_BYTES_MAX`` (64 KiB) each; only the last carries
  the lowercase hex sha256 of the whole ZIP, the others "". No files → no
  chunks at all (the RPC then streams nothing).
- Bounded: a bundle over ``bundle_bytes_max`` (the router's own 200 MiB
  stream limit) is a ``TokenizerBundleError`` rather than a stream the router
  would reject after the transfer.
- Pure: returns a list and caches nothing; the caller decides about caching.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import zipfile
from pathlib import Path

BUNDLE_FILES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "config.json",
        "generation_config.json",
        "special_tokens_map.json",
        "vocab.json",
        "merges.txt",
        "tokenizer.model",
        "tiktoken.model",
        "chat_template.json",
        "preprocessor_config.json",
        "processor_config.json",
        "video_preprocessor_config.json",
    }
)
BUNDLE_GLOBS = ("*.tiktoken", "*.jinja", "*.model")
CHUNK_BYTES_MAX = 65_536
BUNDLE_BYTES_MAX = 200 * 1024 * 1024

# 1980-01-01 is the earliest time a ZIP header can hold.
_FIXED_DATE_TIME = (1980, 1, 1, 0, 0, 0)
_FILE_MODE = 0o100644  # a regular file, rw-r--r--
_CREATE_SYSTEM_UNIX = 3


class TokenizerBundleError(Exception):
    """The bundle could not be built (an unreadable file, or too large)."""


def bundle_file_names(tokenizer_dir: str | Path) -> list[str]:
    """The files of ``tokenizer_dir`` that go into the bundle, sorted."""
    root = Path(tokenizer_dir)
    names = []
    for path in root.iterdir():
        if not path.is_file():
            continue
        # fnmatchcase: "ENGINELINK-TEST-MODEL" is not a "*.model" on any OS.
        if path.name in BUNDLE_FILES or any(
            fnmatch.fnmatchcase(path.name, g) for g in BUNDLE_GLOBS
        ):
            names.append(path.name)
    return sorted(names)


def build_zip(tokenizer_dir: str | Path, *, bundle_bytes_max: int = BUNDLE_BYTES_MAX) -> bytes:
    """The ZIP of the bundle files of ``tokenizer_dir``; b"" when there are none."""
    root = Path(tokenizer_dir)
    try:
        names = bundle_file_names(root)
    except OSError as exc:
        raise TokenizerBundleError(f"{root}: cannot list the tokenizer directory ({exc})") from exc
    if not names:
        return b""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name in names:
            try:
                data = (root / name).read_bytes()
            except OSError as exc:
                raise TokenizerBundleError(f"{root / name}: unreadable ({exc})") from exc
            info = zipfile.ZipInfo(name, date_time=_FIXED_DATE_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.create_system = _CREATE_SYSTEM_UNIX
            info.external_attr = _FILE_MODE << 16
            archive.writestr(info, data, compresslevel=6)
            if buffer.tell() > bundle_bytes_max:
                raise TokenizerBundleError(
                    f"{root}: tokenizer bundle exceeds {bundle_bytes_max} bytes at {name}"
                )
    return buffer.getvalue()


def tokenizer_bundle_chunks(
    tokenizer_dir: str | Path,
    *,
    chunk_bytes: int = CHUNK_BYTES_MAX,
    bundle_bytes_max: int = BUNDLE_BYTES_MAX,
) -> list[tuple[bytes, str]]:
    """GetTokenizer's chunks as ``(data, sha256)`` pairs; sha256 only on the last."""
    if not 0 < chunk_bytes <= CHUNK_BYTES_MAX:
        raise ValueError(f"chunk_bytes must be in 1..{CHUNK_BYTES_MAX}, got {chunk_bytes}")
    blob = build_zip(tokenizer_dir, bundle_bytes_max=bundle_bytes_max)
    if not blob:
        return []
    pieces = [blob[i : i + chunk_bytes] for i in range(0, len(blob), chunk_bytes)]
    digest = hashlib.sha256(blob).hexdigest()
    return [(piece, "") for piece in pieces[:-1]] + [(pieces[-1], digest)]
