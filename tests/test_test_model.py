"""The tiny test model builder (tools/test_model.py): deterministic, complete, loadable."""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import struct

import pytest
from tokenizers import Tokenizer

from enginelink.tools import make_test_model as command
from enginelink.tools import test_model as tm

PARAMETERS = 2_229_504
EXPECTED_FILES = {
    "ENGINELINK-TEST-MODEL",
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}
CHAT_HELLO = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def model_dir(test_model_dir):
    """The session's build (tests/conftest.py): one build fewer; the tests here only read it."""
    return test_model_dir


def _digests(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _safetensors_header(path):
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), len(raw) - 8 - length, length


def test_two_builds_are_byte_identical(model_dir, tmp_path):
    again = tm.make_test_model(tmp_path / "again")
    assert set(_digests(model_dir)) == EXPECTED_FILES
    assert _digests(again) == _digests(model_dir)
    # Nothing but the result is left next to it (the staging folder was renamed).
    assert [p.name for p in tmp_path.iterdir()] == ["again"]


def test_tokenizer_is_the_reference_recipe(model_dir):
    # §3.2/§3.3 of cpu-test-engine.md: same training, same file, same ids.
    assert (
        hashlib.sha256((model_dir / "tokenizer.json").read_bytes())
        .hexdigest()
        .startswith("9d9231c490586cf9")
    )
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tok.get_vocab_size() == 4096
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [
        0,
        1,
        2,
    ]
    assert tok.encode("def foo(x):").ids == [318, 283, 1552, 10, 90, 305]
    assert len(tok.encode(CHAT_HELLO).ids) == 13


@pytest.mark.parametrize(
    "text", ["def foo(x):\n    return x", "héllo wörld ✓ 🙂", "  spaces\ttabs\r\n"]
)
def test_tokenizer_round_trips_text(model_dir, text):
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tok.decode(tok.encode(text).ids) == text


def test_chat_template_renders_chatml(model_dir):
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    template = config["chat_template"]
    assert (model_dir / "chat_template.jinja").read_text() == template
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (
        "<|endoftext|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    assert config["added_tokens_decoder"]["2"]["content"] == "<|im_end|>"
    if importlib.util.find_spec("jinja2") is None:
        # No jinja2 in the base install: check the pieces the render is made of.
        assert (
            "'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'"
            in template
        )
        assert (
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}" in template
        )
        return
    import jinja2

    rendered = (
        jinja2.Environment()
        .from_string(template)
        .render(messages=[{"role": "user", "content": "hello"}], add_generation_prompt=True)
    )
    assert rendered == CHAT_HELLO


def test_safetensors_header_and_sizes(model_dir):
    header, data_bytes, header_bytes = _safetensors_header(model_dir / "model.safetensors")
    assert header.pop("__metadata__") == {"format": "pt"}
    assert header_bytes % 8 == 0
    assert list(header) == sorted(header)
    assert "lm_head.weight" not in header  # tied embeddings
    assert header["model.embed_tokens.weight"]["shape"] == [4096, 256]
    assert header["model.layers.1.self_attn.k_proj.weight"]["shape"] == [128, 256]
    assert header["model.layers.0.mlp.down_proj.weight"]["shape"] == [256, 512]
    end = 0
    for name, entry in header.items():
        assert entry["dtype"] == "BF16", name
        start, stop = entry["data_offsets"]
        assert (start, stop - start) == (end, 2 * math.prod(entry["shape"])), name
        end = stop
    assert sum(math.prod(e["shape"]) for e in header.values()) == PARAMETERS
    assert data_bytes == end == 2 * PARAMETERS


def test_weights_are_normal_and_norms_are_one(model_dir):
    raw = (model_dir / "model.safetensors").read_bytes()
    header, _, length = _safetensors_header(model_dir / "model.safetensors")
    base = 8 + length

    def floats(name):
        start, stop = header[name]["data_offsets"]
        halves = struct.unpack(f"<{(stop - start) // 2}H", raw[base + start : base + stop])
        return [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in halves]

    assert set(floats("model.norm.weight")) == {1.0}
    q = floats("model.layers.0.self_attn.q_proj.weight")
    mean = sum(q) / len(q)
    std = math.sqrt(sum((x - mean) ** 2 for x in q) / len(q))
    assert abs(mean) < 1e-3
    assert abs(std - tm.WEIGHT_STD) < 1e-3


def test_bf16_rounds_to_nearest_even():
    assert tm.to_bf16_bytes([1.0, -2.0, 0.0]) == bytes.fromhex("803f00c00000")
    # 1 + 2**-8 is exactly half-way between two bf16 values: ties go to even.
    assert tm.to_bf16_bytes([1 + 2**-8, 1 + 3 * 2**-8]) == bytes.fromhex("803f823f")


def test_model_and_generation_config(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["vocab_size"], config["hidden_size"], config["head_dim"]) == (4096, 256, 64)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (0, 2, 0)
    assert config["tie_word_embeddings"] is True
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert not {"temperature", "top_p", "top_k"} & generation.keys()


def test_existing_dirs(model_dir, tmp_path, capsys):
    assert tm.is_complete(model_dir)
    assert tm.make_test_model(model_dir) == model_dir  # complete: kept as it is
    other = tmp_path / "other"
    other.mkdir()
    (other / "mine.txt").write_text("keep me")
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    assert command.run(parser.parse_args([str(other)])) == 1
    assert "use --force" in capsys.readouterr().err
    assert (other / "mine.txt").exists()
    assert command.run(parser.parse_args([str(other), "--force"])) == 0
    assert not (other / "mine.txt").exists()
    assert tm.is_complete(other)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]
