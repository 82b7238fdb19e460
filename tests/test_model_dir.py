"""Facts of a model directory (runtime/engine/model_dir.py)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from enginelink.runtime.engine.model_dir import ModelDirError, load_tokenizer, read_model_facts
from enginelink.tools import test_model


def _write(directory, name, obj):
    (directory / name).write_text(obj if isinstance(obj, str) else json.dumps(obj))


@pytest.fixture
def tiny_dir(tmp_path):
    """The test model's config files (no weights, no tokenizer training)."""
    _write(tmp_path, "config.json", test_model.model_config())
    _write(tmp_path, "generation_config.json", test_model.generation_config())
    _write(tmp_path, "tokenizer_config.json", test_model.tokenizer_config())
    return tmp_path


def test_facts_of_the_test_model(tiny_dir):
    facts = read_model_facts(tiny_dir)
    assert facts.model_path == str(tiny_dir)
    assert (facts.vocab_size, facts.max_position_embeddings) == (4096, 2048)
    assert facts.eos_token_ids == (2,)
    assert (facts.bos_token_id, facts.pad_token_id) == (0, 0)
    assert facts.architectures == ("LlamaForCausalLM",)
    assert (facts.model_type, facts.dtype) == ("llama", "bfloat16")
    assert facts.default_sampling_params == {}
    assert facts.default_sampling_params_json == ""
    assert facts.tokenizer_path == str(tiny_dir)
    assert not facts.supports_vision


def test_eos_ids_config_first_then_generation_extras(tmp_path):
    _write(tmp_path, "config.json", {"eos_token_id": [7, 3], "torch_dtype": "float16"})
    _write(tmp_path, "generation_config.json", {"eos_token_id": [3, 9, 7, 11], "bos_token_id": 5})
    facts = read_model_facts(tmp_path)
    assert facts.eos_token_ids == (7, 3, 9, 11)
    assert facts.bos_token_id == 5  # config has none: the generation config's
    assert facts.pad_token_id is None
    assert facts.dtype == "float16"
    assert facts.tokenizer_path == ""
    assert (facts.vocab_size, facts.max_position_embeddings, facts.model_type) == (0, 0, "")


def test_eos_int_in_generation_config_only(tmp_path):
    _write(tmp_path, "config.json", {"eos_token_id": None})
    _write(tmp_path, "generation_config.json", {"eos_token_id": 4})
    assert read_model_facts(tmp_path).eos_token_ids == (4,)


def test_sampling_defaults_keep_only_non_null_known_keys(tmp_path):
    _write(tmp_path, "config.json", {})
    _write(
        tmp_path,
        "generation_config.json",
        {
            "top_p": 0.95,
            "temperature": 0.6,
            "top_k": None,
            "do_sample": True,
            "repetition_penalty": 1.1,
        },
    )
    facts = read_model_facts(tmp_path)
    assert facts.default_sampling_params == {
        "temperature": 0.6,
        "top_p": 0.95,
        "repetition_penalty": 1.1,
    }
    assert json.loads(facts.default_sampling_params_json) == facts.default_sampling_params
    assert facts.default_sampling_params_json.startswith('{"temperature":0.6,')


def test_text_config_of_a_multimodal_model(tmp_path):
    _write(
        tmp_path,
        "config.json",
        {
            "architectures": ["LlavaForConditionalGeneration"],
            "model_type": "llava",
            "text_config": {
                "vocab_size": 32064,
                "max_position_embeddings": 4096,
                "eos_token_id": 2,
            },
            "vision_config": {"hidden_size": 1024},
        },
    )
    facts = read_model_facts(tmp_path)
    assert facts.supports_vision
    assert (facts.vocab_size, facts.max_position_embeddings, facts.eos_token_ids) == (
        32064,
        4096,
        (2,),
    )


def test_missing_dir_names_it(tmp_path):
    with pytest.raises(ModelDirError, match="no such directory"):
        read_model_facts(tmp_path / "nope")
    (tmp_path / "file").write_text("")
    with pytest.raises(ModelDirError, match="not a directory"):
        read_model_facts(tmp_path / "file")


def test_missing_config_names_the_file(tmp_path):
    with pytest.raises(ModelDirError, match=r"config\.json: missing"):
        read_model_facts(tmp_path)


@pytest.mark.parametrize(
    ("name", "text", "problem"),
    [
        ("config.json", "{not json", "not valid JSON"),
        ("config.json", "[1, 2]", "expected a JSON object, got list"),
        ("config.json", '{"eos_token_id": "2"}', "eos_token_id must be an int or a list of ints"),
        ("config.json", '{"vocab_size": -1}', "vocab_size must be a non-negative int"),
        ("config.json", '{"architectures": "Llama"}', "architectures must be a list of strings"),
        ("generation_config.json", "{", "not valid JSON"),
    ],
)
def test_unreadable_files_name_file_and_problem(tmp_path, name, text, problem):
    _write(tmp_path, "config.json", {})
    (tmp_path / name).write_text(text)
    with pytest.raises(ModelDirError) as caught:
        read_model_facts(tmp_path)
    assert str(tmp_path / name) in str(caught.value)
    assert problem in str(caught.value)


def test_undecodable_config(tmp_path):
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ModelDirError, match="unreadable"):
        read_model_facts(tmp_path)


def test_load_tokenizer_from_dir_or_file(tmp_path):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        ["hello world"] * 4, trainers.BpeTrainer(vocab_size=300, show_progress=False)
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    for path in (tmp_path, tmp_path / "tokenizer.json", str(tmp_path)):
        assert load_tokenizer(path).encode("hello").ids == tok.encode("hello").ids


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(ModelDirError, match=r"tokenizer\.json: missing"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelDirError, match="not a loadable tokenizer"):
        load_tokenizer(tmp_path)
