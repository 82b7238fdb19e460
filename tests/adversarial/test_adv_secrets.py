"""Attacks on secrecy: credentials must not reach the servicer's log through the engine's own output.

The engine echoes what it was given (an argument error prints the command
line), so enginelink (1) keeps credentials off the engine's command line
where the engine takes them otherwise (``--hf-token`` → ``HF_TOKEN``;
``--api-key``, which a headless engine never uses, dropped) and (2) relays
everything the engine prints with every known secret value and every
credential-shaped text hidden.
"""

from __future__ import annotations

import io

import pytest
import trio
import trio.testing

from enginelink.journal.records import KIND_ENGINE_HANDSHAKE
from enginelink.journal.store import open_reader
from enginelink.runtime.engine.engine_output import ENGINE_LINE_MAX_BYTES, EngineOutputRelay, Redactor
from enginelink.runtime.contracts.vllm.launch import VllmLauncher
from enginelink.runtime.engine.launchers import REDACTED, SimLauncher, launch_secrets, move_secrets
from tests.harness import Servicer, engine_pid


@pytest.mark.parametrize("line, secret", [
    ("error: unrecognized arguments: --hf-token hf_AbCdEf123 --max-num-seqs 4", "hf_AbCdEf123"),
    ("error: unrecognized arguments: --api-key=sk-live-99", "sk-live-99"),
    ("argv: ['vllm', '--hf-token', 'hf_list_form', '--model', 'm']", "hf_list_form"),
    ("config {'api_key': 'sk-in-a-dict', 'model': 'm'}", "sk-in-a-dict"),
    ('kv_transfer_config={"password":"pw-json-1","role":"kv_both"}', "pw-json-1"),
    ("connecting with token=tok-eq-42 to the store", "tok-eq-42"),
    ("GET https://alice:urlpass77@hub.example/x failed", "urlpass77"),
    ("header Authorization: Bearer bearer-abc-1", "bearer-abc-1"),
    ("--SECRET-KEY VaLuE-upper", "VaLuE-upper"),
])
def test_credential_shaped_text_is_hidden(line, secret):
    redacted = Redactor().line(line)
    assert secret not in redacted and REDACTED in redacted, redacted


@pytest.mark.parametrize("line", [
    "--max-num-batched-tokens 2048 --tokenizer facebook/opt --max-tokens 16",
    "prompt_token_ids=[1, 2, 3] num_tokens: 5 block_size=16",
    "Loading weights took 1.20 seconds (key cache 512 blocks)",
])
def test_ordinary_lines_stay_readable(line):
    assert Redactor().line(line) == line


def test_known_secret_values_are_hidden_wherever_they_appear():
    argv = ["python", "-m", "engine", "--kv-transfer-config", '{"auth":"json-secret-1","x":1}',
            "--hf-token", "hf_flagvalue", "--load-format=s3://bob:s3pass@bucket/m"]
    env = {"MY_SERVICE_API_KEY": "env-secret-value", "PATH": "/usr/bin", "HOME": "/root"}
    secrets = launch_secrets(argv, env)
    assert secrets == {"json-secret-1", "hf_flagvalue", "s3pass", "env-secret-value"}
    redactor = Redactor(secrets)
    for secret in secrets:  # bare, in the middle of prose where no pattern would see it
        line = f"engine: could not open {secret}/weights.bin"
        assert redactor.line(line) == f"engine: could not open {REDACTED}/weights.bin"


def test_secret_flags_leave_the_command_line():
    argv, env, warnings = move_secrets(["--hf-token", "hf_1", "--max-num-seqs", "4", "--api-key=sk-2", "--enforce-eager"])
    assert argv == ["--max-num-seqs", "4", "--enforce-eager"]
    assert env == {"HF_TOKEN": "hf_1"}
    assert len(warnings) == 1 and "--api-key" in warnings[0] and "sk-2" not in warnings[0]
    argv, env, _ = move_secrets(["--hf-token=hf_3", "--api-key", "sk-4"])
    assert argv == [] and env == {"HF_TOKEN": "hf_3"}
    # A bare --hf-token (use the cached login) has no value to move: it stays.
    assert move_secrets(["--hf-token", "--enforce-eager"])[0] == ["--hf-token", "--enforce-eager"]
    for launcher in (SimLauncher(model_dir="m", extra_args=["--hf-token", "hf_5"]),
                     VllmLauncher(python="py", model_dir="m", extra_args=["--hf-token", "hf_5"])):
        argv, env = launcher.command("ipc:///x")
        assert "hf_5" not in " ".join(argv) and env["HF_TOKEN"] == "hf_5"


async def test_the_relay_bounds_lines_and_hides_secrets_split_across_reads():
    sink = io.StringIO()
    send, receive = trio.testing.memory_stream_pair()
    relay = EngineOutputRelay(receive, Redactor({"split-secret-value"}), sink=sink)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay.pump)
        for piece in (b"first: split-sec", b"ret-value here\n", b"x" * (3 * ENGINE_LINE_MAX_BYTES),
                      b"\nlast --api-key=sk-9 without newline"):
            await send.send_all(piece)
        await send.aclose()
    lines = sink.getvalue().splitlines()
    assert lines[0] == f"first: {REDACTED} here"
    assert lines[1].startswith("x" * 100) and lines[1].endswith("by enginelink]")
    assert len(lines[1]) < ENGINE_LINE_MAX_BYTES + 100  # cut, not the 48 KiB line
    assert lines[2] == f"last --api-key={REDACTED} without newline"
    assert relay.done and relay.cut == 1


@pytest.fixture
def secret_env():
    return {"SMG_VLLM_SERVICER_WARMUP": "off", "OPS_DB_PASSWORD": "env-only-secret-77"}


@pytest.mark.process
def test_an_engine_argument_error_reaches_the_log_without_the_secrets(tmp_path, test_model_dir, secret_env):
    secrets = ["hf_moved_to_env_1", "sk-dropped-2", "json-pass-3", "urlpass-4", "env-only-secret-77"]
    servicer = Servicer(tmp_path, model_dir=test_model_dir, env=secret_env, engine_args=[
        "--hf-token", secrets[0], "--api-key", secrets[1],
        "--kv-transfer-config", '{"password": "json-pass-3"}', "--mirror", "https://u:urlpass-4@example.org/m",
        "--echo", "env-only-secret-77",
    ])
    try:
        servicer.start(wait_serving=False)
        assert servicer.wait(60) != 0  # the sim engine refuses the unknown flags; the servicer fails
    finally:
        servicer.stop()
    log = servicer.log()
    assert "unrecognized arguments" in log, log  # the engine's error was relayed...
    for secret in secrets:
        assert secret not in log, (secret, log)  # ...with nothing secret in it
    assert REDACTED in log
    assert "--api-key is a flag of vllm serve's API server" in log
    with open_reader(servicer.journal) as reader:
        launches = [r.payload["message"] for r in reader.records(kinds=[KIND_ENGINE_HANDSHAKE])
                    if r.payload["step"] == "launch"]
    assert launches and not any(secret in str(launches) for secret in secrets)


@pytest.mark.process
@pytest.mark.slow
def test_a_running_engine_gets_its_token_by_environment_not_argv(tmp_path, test_model_dir, secret_env):
    with Servicer(tmp_path, model_dir=test_model_dir, env=secret_env,
                  engine_args=["--hf-token", "hf_running_token_5"]) as servicer:
        pid = engine_pid(servicer.journal)
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            assert b"hf_running_token_5" not in fh.read()
        with open(f"/proc/{pid}/environ", "rb") as fh:
            assert b"HF_TOKEN=hf_running_token_5" in fh.read().split(b"\0")
        assert "hf_running_token_5" not in servicer.log()
