"""Router tensors as an attack surface: dtypes, lengths, shared-memory handles, pixel-less legs.

Attacked several ways each: a tensor's dtype (unknown, a width that does
not match its bytes) and shape (too few bytes, too many, batched rows that
do not match the items); a shared-memory handle that does not exist, that
climbs out of /dev/shm (``..``, an absolute path, a nested name), that is a
symlink to a file elsewhere, a directory, a FIFO, shorter than it claims,
larger than the request's budget, that names another process's file; a
remote handle; a pixel-less batch without ``kv_transfer_params``. A segment
is removed only when its request is good (issue 38, items 2 and 3). Over gRPC (``enginelink serve``, sim engine) each is
INVALID_ARGUMENT and a good request on the same servicer still generates.
"""

from __future__ import annotations

import os
import struct
import threading
import time
import uuid

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2 as pb

from enginelink.runtime.errors import ClientError
from enginelink.runtime.contracts.shared.mm_tensors import batches_of, build_features, mm_features_of
from tests.harness import generate_request

IMG = 9
PROMPT = [5, 6, IMG, IMG, 7]


def _f32(n: int) -> bytes:
    return struct.pack(f"<{n}f", *[float(i) for i in range(n)])


def _request(**tweaks) -> pb.GenerateRequest:
    request = generate_request("mm-1", PROMPT, max_tokens=2)
    mm = request.mm_inputs
    mm.modality = common_pb2.IMAGE
    mm.pixel_values.dtype, mm.pixel_values.inline = "float32", _f32(8)
    mm.pixel_values.shape.extend([1, 2, 4])
    grid = mm.model_specific_tensors["image_grid_thw"]
    grid.dtype, grid.inline = "int64", struct.pack("<3q", 1, 1, 2)
    grid.shape.extend([1, 3])
    mm.batched_keys.extend(["pixel_values", "image_grid_thw"])
    mm.mm_placeholders.add(offset=2, length=2)
    mm.mm_hashes.append("img-hash")
    mm.im_token_id = IMG
    for apply in tweaks.values():
        apply(request)
    return request


def _refused(request, bytes_max: int = 1 << 30) -> ClientError:
    with pytest.raises(ClientError) as error:
        build_features(batches_of(request), list(request.tokenized.input_ids), bytes_max)
    return error.value


@pytest.fixture
def shm_segment():
    """A /dev/shm segment this test owns (removed after, if the code under test left it)."""
    made = []

    def make(data: bytes) -> str:
        name = f"smg-mm-el-test-{uuid.uuid4().hex}"
        with open(f"/dev/shm/{name}", "wb") as handle:
            handle.write(data)
        made.append(name)
        return name

    yield make
    for name in made:
        try:
            os.unlink(f"/dev/shm/{name}")
        except FileNotFoundError:
            pass


def _via_shm(name: str, nbytes: int, offset: int = 0):
    def apply(request):
        pixels = request.mm_inputs.pixel_values
        pixels.shm.name, pixels.shm.nbytes, pixels.shm.offset = name, nbytes, offset
    return apply


def test_a_good_batch_becomes_one_feature():
    [feature] = build_features(batches_of(_request()), PROMPT, 1 << 30)
    assert feature["identifier"] == "img-hash" and feature["mm_position"]["offset"] == 2
    assert feature["data"]["pixel_values"]["data"][:2] == ["float32", [2, 4]]


@pytest.mark.parametrize("dtype,data,shape,words", [
    ("float64", _f32(8), [1, 2, 4], "dtype 'float64' is not one of"),
    ("complex64", _f32(8), [1, 2, 4], "dtype 'complex64'"),
    ("float16", _f32(8), [1, 2, 4], "expected 16"),  # the width disagrees with the bytes
    ("float32", _f32(7), [1, 2, 4], "28 bytes"),
    ("float32", _f32(9), [1, 2, 4], "36 bytes"),
    ("float32", _f32(8), [2, 2, 2], "batched tensor of shape [2, 2, 2] for 1 items"),
])  # fmt: skip
def test_wrong_dtype_or_shape_is_invalid_argument(dtype, data, shape, words):
    def apply(request):
        pixels = request.mm_inputs.pixel_values
        pixels.dtype, pixels.inline = dtype, data
        del pixels.shape[:]
        pixels.shape.extend(shape)
    error = _refused(_request(x=apply))
    assert error.field.startswith("mm_inputs.pixel_values") and words in str(error), str(error)


def test_a_shared_memory_segment_is_read_once_and_unlinked(shm_segment):
    name = shm_segment(b"junk" + _f32(8))
    [feature] = build_features(batches_of(_request(x=_via_shm(name, 32, offset=4))), PROMPT, 1 << 30)
    assert feature["data"]["pixel_values"]["data"][2].data == _f32(8)
    assert not os.path.exists(f"/dev/shm/{name}")


@pytest.mark.parametrize("name,words", [
    ("smg-mm-el-test-does-not-exist", "cannot be opened under /dev/shm"),
    ("el-test-not-the-routers", "must name a segment the router wrote"),
    ("../../etc/passwd", "must be one file name under /dev/shm"),
    ("/etc/passwd", "must be one file name under /dev/shm"),
    ("a/b", "must be one file name"),
    ("..", "must be one file name"),
    ("", "must be one file name"),
    ("x\x00y", "must be one file name"),
])  # fmt: skip
def test_a_handle_that_is_missing_or_outside_dev_shm_is_refused(name, words):
    error = _refused(_request(x=_via_shm(name, 32)))
    assert error.field.startswith("mm_inputs.pixel_values.shm") and words in str(error)


def test_a_symlink_or_directory_in_dev_shm_is_refused(tmp_path):
    target = tmp_path / "secret"
    target.write_bytes(_f32(8))
    link, folder = f"smg-mm-el-test-{uuid.uuid4().hex}", f"smg-mm-el-test-{uuid.uuid4().hex}"
    os.symlink(target, f"/dev/shm/{link}")
    os.mkdir(f"/dev/shm/{folder}")
    try:
        assert "is a symlink" in str(_refused(_request(x=_via_shm(link, 32))))
        assert "not a regular file" in str(_refused(_request(x=_via_shm(folder, 32))))
        assert target.exists()
    finally:
        os.unlink(f"/dev/shm/{link}")
        os.rmdir(f"/dev/shm/{folder}")


def test_a_handle_shorter_than_it_claims_or_over_the_budget_is_refused(shm_segment):
    name = shm_segment(_f32(4))
    assert "holds 16 bytes, fewer than the 32 claimed" in str(_refused(_request(x=_via_shm(name, 32))))
    assert os.path.exists(f"/dev/shm/{name}")  # refused: not consumed
    name = shm_segment(_f32(8))
    error = _refused(_request(x=_via_shm(name, 32)), bytes_max=16)
    assert "ENGINELINK_MM_MAX_TENSOR_BYTES" in str(error)
    assert os.path.exists(f"/dev/shm/{name}")  # refused before it was opened


def test_another_processs_file_is_never_removed(tmp_path):
    """Issue 38, item 2: a handle naming another process's segment with a wrong size was refused,
    but only after the file was unlinked: any client could delete any file directly in /dev/shm."""
    victim = f"el-victim-{uuid.uuid4().hex}"  # not in the router's naming
    with open(f"/dev/shm/{victim}", "wb") as handle:
        handle.write(b"someone else's")
    try:
        for nbytes in (7, 14, 4096):
            error = _refused(_request(x=_via_shm(victim, nbytes)))
            assert "must name a segment the router wrote" in str(error)
            with open(f"/dev/shm/{victim}", "rb") as handle:
                assert handle.read() == b"someone else's"
    finally:
        os.unlink(f"/dev/shm/{victim}")


def test_a_segment_is_kept_when_its_request_is_refused(shm_segment):
    """A segment in the router's naming is removed only once its whole request is good: the size it
    claims wrong, or another tensor of the request refused, and it stays."""
    wrong_size = shm_segment(_f32(8))
    _refused(_request(x=_via_shm(wrong_size, 64)))
    good = shm_segment(_f32(8))

    def bad_grid(request):
        request.mm_inputs.model_specific_tensors["image_grid_thw"].dtype = "complex64"

    _refused(_request(x=_via_shm(good, 32), y=bad_grid))
    _refused(_request(x=_via_shm(good, 32), y=lambda r: r.mm_inputs.mm_placeholders.add(offset=40, length=2)))
    for name in (wrong_size, good):
        assert os.path.getsize(f"/dev/shm/{name}") == 32, name
    build_features(batches_of(_request(x=_via_shm(good, 32))), PROMPT, 1 << 30)
    assert not os.path.exists(f"/dev/shm/{good}")  # consumed by the good request


def test_a_segment_swapped_after_the_read_is_not_removed(shm_segment):
    from enginelink.runtime.requests.local_files import read_regular, remove_if_same

    name = shm_segment(_f32(8))
    path = f"/dev/shm/{name}"
    read = read_regular(path, nbytes=32)
    os.unlink(path)
    with open(path, "wb") as handle:  # another file under the same name
        handle.write(b"new")
    assert remove_if_same(path, read) is False
    assert open(path, "rb").read() == b"new"


def _release_after(path: str, seconds: float) -> threading.Thread:
    """After ``seconds``, open the FIFO's write end once: a reader stuck in open() (the bug) comes back."""

    def release():
        deadline = time.monotonic() + seconds + 30
        time.sleep(seconds)
        while time.monotonic() < deadline:
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                return
            except OSError:  # ENXIO: no reader yet; ENOENT: the test is over
                if not os.path.exists(path):
                    return
                time.sleep(0.05)

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    return thread


def test_a_fifo_is_refused_at_once_and_never_blocks():
    """Issue 38, item 3: any local user can mkfifo in /dev/shm; opening it blocked a worker thread past every timeout."""
    name = f"smg-mm-el-test-{uuid.uuid4().hex}"
    os.mkfifo(f"/dev/shm/{name}")
    try:
        _release_after(f"/dev/shm/{name}", 5)
        started = time.monotonic()
        error = _refused(_request(x=_via_shm(name, 32)))
        assert time.monotonic() - started < 2, "the read waited on the FIFO"
        assert "a FIFO" in str(error)
        assert os.path.exists(f"/dev/shm/{name}")
    finally:
        os.unlink(f"/dev/shm/{name}")


def test_remote_and_empty_payloads_are_refused():
    def remote(request):
        request.mm_inputs.pixel_values.remote.SetInParent()

    assert "remote tensor handle is not supported" in str(_refused(_request(x=remote)))

    def empty(request):
        request.mm_inputs.pixel_values.ClearField("inline")

    assert "has no payload" in str(_refused(_request(x=empty)))


def _pixel_less(request):
    request.mm_inputs.ClearField("pixel_values")
    del request.mm_inputs.batched_keys[:]
    request.mm_inputs.batched_keys.append("image_grid_thw")


async def test_a_pixel_less_leg_needs_kv_transfer_params():
    request = _request(x=_pixel_less)
    with pytest.raises(ClientError, match="a pixel-less leg requires remote KV"):
        await mm_features_of(request, PROMPT, has_kv_transfer=False)
    [feature] = await mm_features_of(request, PROMPT, has_kv_transfer=True)
    assert set(feature["data"]) == {"image_grid_thw"}


# -- over gRPC: the codes, and the engine still serving -----------------------------------


@pytest.mark.slow
def test_over_grpc_bad_tensors_are_invalid_argument_and_a_good_one_generates(servicer):
    def bad_dtype(request):
        request.mm_inputs.pixel_values.dtype = "float64"

    def missing_shm(request):
        _via_shm("smg-mm-el-test-nope", 32)(request)

    def outside(request):
        _via_shm("../../etc/passwd", 32)(request)

    for tweak in (bad_dtype, missing_shm, outside, _pixel_less):
        with pytest.raises(grpc.RpcError) as error:
            list(servicer.stub.Generate(_request(x=tweak), timeout=20))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
        assert "mm_inputs" in error.value.details()
    replies = list(servicer.stub.Generate(_request(), timeout=20))
    assert replies[-1].complete.completion_tokens == 2
