"""Helpers of the real-package codec tests: the struct-only engine venvs and their peer.

The venvs come from ``tools/setup-sglang`` / ``tools/setup-tokenspeed``
(``tools/run-tests`` builds them). Without one the real-package tests skip,
unless ``ENGINELINK_REQUIRE_SGLANG=1`` / ``ENGINELINK_REQUIRE_TOKENSPEED=1``
(``tools/run-tests`` sets them), where that fails.
"""

from __future__ import annotations

import os
import subprocess
from array import array
from pathlib import Path
from typing import Any

import msgspec
import pytest

from enginelink.runtime.contracts.shared import engine_compat
from enginelink.wire.sglang_structs import EXT_ARRAY, unpack_array

PEER = Path(__file__).with_name("engine_peer.py")
LAYOUTS = Path(__file__).with_name("layouts")
PEER_TIMEOUT_S = 600.0


def side_python_or_skip(engine: str) -> str:
    python = engine_compat.default_python(engine)
    if not Path(python).exists():
        spec = engine_compat.ENGINES[engine]
        reason = f"no {spec.title} venv at {python} (run {spec.setup})"
        if os.environ.get(f"ENGINELINK_REQUIRE_{engine.upper()}") == "1":
            pytest.fail(f"{spec.title} is required here: {reason}")
        pytest.skip(reason)
    return python


def plain(value: Any) -> Any:
    """Our struct values as the peer's keyword arguments (arrays and nested structs marked)."""
    if isinstance(value, msgspec.msgpack.Ext) and value.code == EXT_ARRAY:
        arr = unpack_array(value.data)
        return {"__array__": [arr.typecode, arr.tolist()]}
    if isinstance(value, array):
        return {"__array__": [value.typecode, value.tolist()]}
    if isinstance(value, msgspec.Struct):
        return {"__struct__": struct_name(type(value)), "fields": fields_of(value)}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def struct_name(cls: type) -> str:
    tag = cls.__struct_config__.tag
    return tag if isinstance(tag, str) else {"HandshakeAddresses": "WireHandshakeAddresses",
                                             "HandshakeInit": "WireHandshakeInitMessage"}.get(cls.__name__, cls.__name__)


def fields_of(struct: msgspec.Struct) -> dict:
    return {f.name: plain(getattr(struct, f.name)) for f in msgspec.structs.fields(struct)}


def canon(value: Any) -> Any:
    """A comparable form: structs as (name, fields), arrays and Ext 1 as lists, sets sorted."""
    if isinstance(value, msgspec.msgpack.Ext) and value.code == EXT_ARRAY:
        return unpack_array(value.data).tolist()
    if isinstance(value, array):
        return value.tolist()
    if isinstance(value, msgspec.Struct):
        return (struct_name(type(value)), {f.name: canon(getattr(value, f.name)) for f in msgspec.structs.fields(value)})
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, (list, tuple)):
        return [canon(v) for v in value]
    if isinstance(value, dict):
        return {k: canon(v) for k, v in value.items()}
    return value


def run_peer(engine: str, python: str, cases: list[dict], tmp: Path) -> dict[str, dict]:
    """Every case answered by the real package, in one subprocess of its venv."""
    cases_path, results_path = tmp / f"{engine}-cases.msgpack", tmp / f"{engine}-results.msgpack"
    cases_path.write_bytes(msgspec.msgpack.encode(cases))
    done = subprocess.run([python, str(PEER), engine, str(cases_path), str(results_path)],
                          capture_output=True, text=True, timeout=PEER_TIMEOUT_S)
    assert done.returncode == 0, f"the {engine} peer failed:\n{done.stderr[-3000:]}"
    return msgspec.msgpack.decode(results_path.read_bytes())


def installed_layout(engine: str, python: str) -> dict:
    """The venv's own layout, asked fresh (never the cache: the test is the check of the check)."""
    done = subprocess.run([python, str(engine_compat.LAYOUT_SCRIPT), engine], capture_output=True, text=True,
                          timeout=PEER_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return msgspec.json.decode(done.stdout.strip().splitlines()[-1])
