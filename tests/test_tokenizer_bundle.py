"""The GetTokenizer ZIP and its chunks (runtime/engine/tokenizer_bundle.py)."""

from __future__ import annotations

import hashlib
import io
import os
import random
import zipfile

import pytest

from enginelink.runtime.engine.tokenizer_bundle import (
    CHUNK_BYTES_MAX,
    TokenizerBundleError,
    build_zip,
    tokenizer_bundle_chunks,
)


def _unzip(chunks):
    blob = b"".join(data for data, _ in chunks)
    return blob, zipfile.ZipFile(io.BytesIO(blob))


def _check_chunking(chunks):
    assert chunks, "expected at least one chunk"
    assert all(0 < len(data) <= CHUNK_BYTES_MAX for data, _ in chunks)
    assert [sha for _, sha in chunks[:-1]] == [""] * (len(chunks) - 1)
    blob = b"".join(data for data, _ in chunks)
    assert chunks[-1][1] == hashlib.sha256(blob).hexdigest()


def test_bundle_of_the_test_model(test_model_dir):
    model_dir = test_model_dir  # the session's build: the bundle only reads it
    chunks = tokenizer_bundle_chunks(model_dir)
    _check_chunking(chunks)
    _, archive = _unzip(chunks)
    assert archive.testzip() is None
    assert archive.namelist() == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert "model.safetensors" not in archive.namelist()
    for name in archive.namelist():
        assert archive.read(name) == (model_dir / name).read_bytes()


def test_only_tokenizer_files_go_in(tmp_path):
    wanted = {
        "tokenizer.json": random.Random(0).randbytes(200_000),  # incompressible: several chunks
        "merges.txt": b"a b\n",
        "vocab.json": b"{}",
        "tokenizer.model": b"sp",
        "cl100k.tiktoken": b"tt",
        "template.jinja": b"{{ x }}",
        "spm.model": b"spm",
    }
    for name, data in wanted.items():
        (tmp_path / name).write_bytes(data)
    for name in (
        "model.safetensors",
        "pytorch_model.bin",
        "ENGINELINK-TEST-MODEL",
        "README.md",
        "x.MODEL",
    ):
        (tmp_path / name).write_bytes(b"not a tokenizer file")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "tokenizer.json").write_bytes(b"nested")
    (tmp_path / "link.jinja").symlink_to(tmp_path / "template.jinja")

    chunks = tokenizer_bundle_chunks(tmp_path)
    _check_chunking(chunks)
    assert len(chunks) == 4
    _, archive = _unzip(chunks)
    assert archive.namelist() == sorted([*wanted, "link.jinja"])
    assert archive.read("tokenizer.json") == wanted["tokenizer.json"]
    assert archive.read("link.jinja") == wanted["template.jinja"]


def test_zip_is_deterministic(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    # Written in opposite orders, with another mtime and mode.
    for name in ("tokenizer.json", "config.json"):
        (tmp_path / "a" / name).write_text(name)
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / "b" / name).write_text(name)
    (tmp_path / "b" / "config.json").chmod(0o600)
    os.utime(tmp_path / "b" / "config.json", (1e9, 1e9))
    assert build_zip(tmp_path / "a") == build_zip(tmp_path / "b")
    info = zipfile.ZipFile(io.BytesIO(build_zip(tmp_path / "a"))).infolist()[0]
    assert info.date_time == (1980, 1, 1, 0, 0, 0)


def test_empty_dir_gives_no_chunks(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"weights only")
    assert tokenizer_bundle_chunks(tmp_path) == []


def test_small_chunks_and_exact_multiple(tmp_path):
    (tmp_path / "tokenizer.json").write_bytes(b"x" * 1000)
    blob = build_zip(tmp_path)
    for size in (1, 7, len(blob)):
        chunks = tokenizer_bundle_chunks(tmp_path, chunk_bytes=size)
        assert len(chunks) == -(-len(blob) // size)
        assert b"".join(d for d, _ in chunks) == blob
        assert chunks[-1][1] == hashlib.sha256(blob).hexdigest()
    with pytest.raises(ValueError):
        tokenizer_bundle_chunks(tmp_path, chunk_bytes=CHUNK_BYTES_MAX + 1)


def test_bound_and_errors(tmp_path):
    (tmp_path / "tokenizer.json").write_bytes(random.Random(1).randbytes(10_000))
    with pytest.raises(TokenizerBundleError, match="exceeds 5000 bytes"):
        tokenizer_bundle_chunks(tmp_path, bundle_bytes_max=5000)
    with pytest.raises(TokenizerBundleError, match="cannot list"):
        build_zip(tmp_path / "missing")
