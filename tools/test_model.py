"""The tiny test model, offline and deterministic (``enginelink make-test-model [DIR]``: ``make_test_model.py``).

Builds the model directory of reference/cpu-test-engine.md §3 — a random-weight
Llama (2,229,504 parameters, bf16, tied embeddings) and a byte-level BPE
tokenizer trained on the standard library, with a ChatML chat template —
without torch or transformers: the base install has only ``tokenizers``.

Rules:

- Deterministic: two builds with the same Python and ``tokenizers`` are
  byte-identical. No clocks, no hash-seeded ordering, no network. The
  tokenizer is trained exactly per §3.1, so its ``tokenizer.json`` is the
  reference file itself; the JSON files are written as transformers writes
  them (``indent=2``, sorted keys, final newline).
- Weights are written in pure Python (``array`` bulk ops, bf16 by rounding to
  nearest even); the values come from ``init_values`` alone, the one place to
  tune them.
- Atomic: everything is written into a temporary sibling folder, the
  ``ENGINELINK-TEST-MODEL`` marker last, then renamed into place. A folder with
  a marker of the current recipe is complete; callers test ``is_complete``.
"""

from __future__ import annotations

import array
import email
import json
import math
import random
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

# Bump when any output byte changes, so old builds stop counting as complete.
RECIPE_VERSION = 2
MARKER_NAME = "ENGINELINK-TEST-MODEL"

WEIGHT_SEED = 0
# Large enough that greedy output depends on the prompt and keeps changing
# along the sequence (at 0.02 the residual stream dominates and a model repeats
# one token forever), with top-2 logit margins of whole bf16 steps, so output
# equality between two runs of the same engine means something. Checked with
# vLLM 0.32 on CPU (tests/vllm/).
WEIGHT_STD = 0.3  # every projection matrix
EMBED_STD = 1.0  # the (tied) token embeddings

VOCAB_SIZE = 4096
HIDDEN_SIZE = 256
INTERMEDIATE_SIZE = 512
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 64
MAX_POSITIONS = 2048
CORPUS_FILES = 200

BOS, BOS_ID = "<|endoftext|>", 0
IM_START = "<|im_start|>"
EOS, EOS_ID = "<|im_end|>", 2
PAD_ID = 0
SPECIAL_TOKENS = (BOS, IM_START, EOS)  # ids 0, 1, 2 in this order

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# --- tokenizer ------------------------------------------------------------


def corpus_files() -> list[Path]:
    """The first 200 top-level stdlib modules, sorted by path (§3.1)."""
    stdlib = Path(email.__file__).parent.parent
    return sorted(stdlib.glob("*.py"))[:CORPUS_FILES]


def _corpus_lines() -> Iterator[str]:
    for path in corpus_files():
        with open(path, encoding="utf-8", errors="ignore") as fh:
            yield from fh


def train_tokenizer():
    """The byte-level BPE of §3.1, as a ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus_lines(), trainer)
    return bpe


def _special(content: str) -> dict:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
    }


def tokenizer_config() -> dict:
    # As PreTrainedTokenizerFast.save_pretrained writes it, with the two §3.1
    # patches: chat_template inline, tokenizer_class loadable by transformers 4.
    return {
        "added_tokens_decoder": {
            str(i): {**_special(t), "special": True} for i, t in enumerate(SPECIAL_TOKENS)
        },
        "bos_token": BOS,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "extra_special_tokens": {},
        "model_max_length": MAX_POSITIONS,
        "pad_token": BOS,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def special_tokens_map() -> dict:
    return {"bos_token": _special(BOS), "eos_token": _special(EOS), "pad_token": _special(BOS)}


# --- model config -----------------------------------------------------------


def model_config() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_ID,
        # transformers 5 reads "dtype", transformers 4 "torch_dtype".
        "dtype": "bfloat16",
        "eos_token_id": EOS_ID,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN_SIZE,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE_SIZE,
        "max_position_embeddings": MAX_POSITIONS,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": NUM_HEADS,
        "num_hidden_layers": NUM_LAYERS,
        "num_key_value_heads": NUM_KV_HEADS,
        "pad_token_id": PAD_ID,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
    }


def generation_config() -> dict:
    # No sampling defaults: GetModelInfo's default_sampling_params_json is "".
    return {
        "_from_model_config": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
    }


# --- weights ------------------------------------------------------------------


def tensor_shapes() -> dict[str, tuple[int, ...]]:
    """Llama parameter names → shapes (torch's [out, in]); no lm_head (tied)."""
    q_out, kv_out = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (VOCAB_SIZE, HIDDEN_SIZE),
        "model.norm.weight": (HIDDEN_SIZE,),
    }
    for i in range(NUM_LAYERS):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.self_attn.q_proj.weight": (q_out, HIDDEN_SIZE),
            f"{layer}.self_attn.k_proj.weight": (kv_out, HIDDEN_SIZE),
            f"{layer}.self_attn.v_proj.weight": (kv_out, HIDDEN_SIZE),
            f"{layer}.self_attn.o_proj.weight": (HIDDEN_SIZE, q_out),
            f"{layer}.mlp.gate_proj.weight": (INTERMEDIATE_SIZE, HIDDEN_SIZE),
            f"{layer}.mlp.up_proj.weight": (INTERMEDIATE_SIZE, HIDDEN_SIZE),
            f"{layer}.mlp.down_proj.weight": (HIDDEN_SIZE, INTERMEDIATE_SIZE),
            f"{layer}.input_layernorm.weight": (HIDDEN_SIZE,),
            f"{layer}.post_attention_layernorm.weight": (HIDDEN_SIZE,),
        }
    return dict(sorted(shapes.items()))


def init_values(name: str, count: int) -> list[float]:
    """The values of one tensor: RMSNorm scales 1.0, embeddings N(0, EMBED_STD),
    every other matrix N(0, WEIGHT_STD).

    Each tensor draws from its own ``random.Random`` seeded by name (string
    seeds hash with sha512, stable across runs), so changing one tensor's init
    leaves the others as they were.
    """
    if name.endswith("norm.weight"):
        return [1.0] * count
    gauss = random.Random(f"{WEIGHT_SEED}/{name}").gauss
    std = EMBED_STD if name == "model.embed_tokens.weight" else WEIGHT_STD
    return [gauss(0.0, std) for _ in range(count)]


def to_bf16_bytes(values: list[float]) -> bytes:
    """Little-endian bf16 of ``values``, rounded to nearest even (finite input)."""
    bits = array.array("I")
    assert bits.itemsize == 4
    bits.frombytes(array.array("f", values).tobytes())
    halves = array.array("H", [(b + 0x7FFF + ((b >> 16) & 1)) >> 16 for b in bits])
    if sys.byteorder == "big":
        halves.byteswap()
    return halves.tobytes()


def safetensors_bytes() -> bytes:
    """The whole model.safetensors: 8-byte LE header length, JSON header, data."""
    header: dict = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, shape in tensor_shapes().items():
        blob = to_bf16_bytes(init_values(name, math.prod(shape)))
        header[name] = {
            "dtype": "BF16",
            "shape": list(shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return len(head).to_bytes(8, "little") + head + b"".join(blobs)


# --- the build ----------------------------------------------------------------


def _json_text(obj: dict) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def marker_text(version: int = RECIPE_VERSION) -> str:
    return f"recipe {version}\n"


def is_complete(model_dir: Path, marker_name: str = MARKER_NAME, version: int = RECIPE_VERSION) -> bool:
    """Whether ``model_dir`` holds a finished build of the recipe ``version`` (its marker, written last)."""
    try:
        return (Path(model_dir) / marker_name).read_text() == marker_text(version)
    except OSError:
        return False


def _write_all(out: Path) -> None:
    (out / "tokenizer.json").write_text(train_tokenizer().to_str(pretty=True), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(_json_text(tokenizer_config()), encoding="utf-8")
    (out / "special_tokens_map.json").write_text(_json_text(special_tokens_map()), encoding="utf-8")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    (out / "config.json").write_text(_json_text(model_config()), encoding="utf-8")
    (out / "generation_config.json").write_text(_json_text(generation_config()), encoding="utf-8")
    (out / "model.safetensors").write_bytes(safetensors_bytes())
    (out / MARKER_NAME).write_text(marker_text())  # last: it certifies the rest


def make_test_model(out_dir: Path, *, force: bool = False) -> Path:
    """Build the test model at ``out_dir`` and return it.

    A complete build of the current recipe is kept as it is unless ``force``.
    Any other existing ``out_dir`` is refused (``FileExistsError``) unless
    ``force``, which replaces it.
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        if is_complete(out_dir) and not force:
            return out_dir
        if not force and (not out_dir.is_dir() or any(out_dir.iterdir())):
            raise FileExistsError(
                f"{out_dir} exists and is not a complete test model; use --force to replace it"
            )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.build-", dir=out_dir.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it 0700; a model dir is readable like any other
        _write_all(staging)
        if out_dir.exists() or out_dir.is_symlink():
            # rename() cannot replace a non-empty folder: move the old one aside.
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            out_dir.rename(old / "old")
            staging.rename(out_dir)
            shutil.rmtree(old)
        else:
            staging.rename(out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out_dir


def hub_commit(repo_id: str) -> str:
    """The commit the test model is filed under in a Hub cache: 40 hex digits (what huggingface_hub takes
    as a commit), the same for the same recipe and id."""
    import hashlib

    return hashlib.sha1(f"enginelink-test-model {RECIPE_VERSION} {repo_id}".encode()).hexdigest()


def place_in_hub_cache(model_dir: Path, cache_dir: Path, repo_id: str, *, ref: str = "main") -> Path:
    """File ``model_dir``'s files in the Hugging Face cache ``cache_dir`` as ``repo_id``'s snapshot on
    ``ref`` (``models--ORG--NAME/snapshots/COMMIT/…``, ``refs/REF``), as ``hf download`` would leave it
    (files copied, not linked to blobs: readers go through the snapshot); the snapshot's path.

    What a machine without the Hub needs to serve a Hub id offline (``HF_HUB_OFFLINE=1``)."""
    commit = hub_commit(repo_id)
    repo = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(Path(model_dir).iterdir()):
        if file.is_file() and file.name != MARKER_NAME:
            shutil.copyfile(file, snapshot / file.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)  # last: a ref names a complete snapshot
    return snapshot


def default_test_model_path() -> Path:
    """Where ``enginelink serve`` builds and keeps the test model: the state dir's ``test-model``."""
    import platformdirs

    return Path(platformdirs.user_state_dir("enginelink")) / "test-model"
