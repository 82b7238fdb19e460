"""The installed vLLM 0.32.0 against its layout file, and vLLM's own decoder reading what enginelink writes for 0.34.0.

``tools/vllm_layouts.py`` reads every release's layout out of its wheel
with ``ast``; here the release the suite runs is described by introspection
(``wire/vllm_layout.py`` run with its interpreter) and must be the same, so
the wheel reader is checked against a real package (0.28.0's in
``tests/vllm_0_28/``). 0.34.0 cannot run here (CUDA only), but its one
change to what a front end writes, prompt ids as an int32 array, is read by
vLLM's own ``MsgpackDecoder`` (``vllm/v1/serial_utils.py``, the same code in
0.32.0 and 0.34.0) into a struct declared as 0.34.0's layout declares it.
"""

from __future__ import annotations

import json
import subprocess

import msgspec
import pytest

from enginelink.wire import vllm, vllm_layout, vllm_release
from enginelink.wire.engine import GenerateSpec, SamplingSpec
from tests.wire import vllm_front_end

pytestmark = pytest.mark.vllm


# One interpreter (one vLLM import): the installed release described, and 0.34.0's EngineCoreRequest,
# built from its layout file with vLLM's own SamplingParams, read by vLLM's own decoder.
DESCRIBE_AND_DECODE_0_34 = """
import importlib.util, json, sys
from typing import Any
spec = importlib.util.spec_from_file_location("vllm_layout_script", sys.argv[1])
layout = importlib.util.module_from_spec(spec)
spec.loader.exec_module(layout)
import msgspec, numpy as np
from vllm.sampling_params import SamplingParams
from vllm.v1.serial_utils import MsgpackDecoder
fields = json.loads(sys.argv[2])
types = {"prompt_token_ids": np.ndarray | None, "sampling_params": SamplingParams | None}
spec = [(f["name"], types.get(f["name"], Any)) if f["required"] else (f["name"], types.get(f["name"], Any), f["default"])
        for f in fields]
Request = msgspec.defstruct("EngineCoreRequest", spec, array_like=True, omit_defaults=True)
r = MsgpackDecoder(Request).decode([sys.stdin.buffer.read()])
read = {"prompt": r.prompt_token_ids.tolist(), "dtype": str(r.prompt_token_ids.dtype),
        "max_tokens": r.sampling_params.max_tokens, "block_hashes": r.block_hashes, "request_id": r.request_id}
print(json.dumps([layout.installed(), read]))
"""
PROMPT_0_34 = list(range(100, 180))


@pytest.fixture(scope="module")
def described(vllm_python) -> tuple[dict, dict, bytes]:
    """(the installed layout, what its decoder read of our 0.34.0 ADD, that ADD's payload)."""
    fields = vllm_layout.load("0.34.0")["structs"]["EngineCoreRequest"]["fields"]
    spec = GenerateSpec(request_id="r34", prompt_token_ids=PROMPT_0_34, arrival_time=1.0,
                        sampling=SamplingSpec(max_tokens=5))
    (_, payload) = vllm.VllmCodec(release=vllm_release.for_release("0.34.0")).encode_add(spec)
    done = subprocess.run([vllm_python, "-c", DESCRIBE_AND_DECODE_0_34, str(vllm_layout.__file__), json.dumps(fields)],
                          input=payload, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    installed, read = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return installed, read, payload


def test_the_installed_release_is_its_layout_file(described):
    installed, _, _ = described
    assert installed["release"] == "0.32.0"
    assert vllm_layout.compare(vllm_layout.load("0.32.0"), installed) == []
    assert vllm_release.speakable(installed) == []


def test_vllms_decoder_reads_the_int32_prompt_array_written_for_0_34(described):
    _, read, payload = described
    assert read == {"prompt": PROMPT_0_34, "dtype": "int32", "max_tokens": 5, "block_hashes": None,
                    "request_id": "r34"}
    assert len(msgspec.msgpack.decode(payload)) == 23


def test_the_structured_output_rules_are_the_installed_releases(vllm_python):
    done = subprocess.run([vllm_python, "-c", vllm_front_end.FRONT_END,
                           json.dumps([vllm_front_end.SCHEMAS, vllm_front_end.CHOICES])],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == vllm_front_end.ours("0.32.0")
