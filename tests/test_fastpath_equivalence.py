"""The fast path against grpclib's own send path: same calls, same frames decoded, same flow-control windows.

One HTTP/2 connection carries ``STREAMS`` concurrent streaming Generate calls to
a real grpclib server in this process (``tests/grpc_pair.py``), once with
``ENGINELINK_FAST_PATH`` on (direct DATA frames, pre-built header blocks,
the coalescing transport) and once off (grpclib sends every byte). The
client is a raw h2 connection (its own windows, its own reading), so it sees
every frame and h2 itself refuses a DATA frame beyond a window it granted.

Scenarios, each both ways:
- ``small_windows``: SETTINGS_INITIAL_WINDOW_SIZE of 256 bytes per stream and
  a connection window the client tops up only to 1 KiB once the first 64 KiB
  are spent, so nearly every send waits for a WINDOW_UPDATE;
- ``stalled_reader``: as above, and the client stops reading (and granting)
  after its first frames, until the server has spent every credit it had, then resumes;
- ``reset``: as above, and the client resets every third stream
  (RST_STREAM CANCEL) after its first few messages.

What must hold (the test fails otherwise):
- per stream, the same decoded response headers, the same trailers, and the
  same messages: the token ids of the chunks in order, then one complete
  (finish reason and counts; its ``output_ids`` repeat the last chunk's,
  chunk boundaries follow the client's pace and ``cached_tokens`` the
  engine's order of same-prompt calls, so those are not compared); a
  reset stream got a prefix of what its twin request got;
- at every quiet point (the reader stalled, each scenario's end) the
  server's h2 outbound windows, the connection's and every open stream's,
  equal what the client's h2 granted minus what it received (synchronised by
  a PING, which the server answers behind everything it sent); while the
  reader is stalled the server has used all of its credit (an accounting that
  charged without sending would leave some); at the end both paths hold the
  same connection window;
- nothing is left behind: no h2 stream open, no stream registered in
  grpclib's processor, no call in the hub.
"""

from __future__ import annotations

import struct

import h2.config
import h2.connection
import h2.events
import pytest
import trio
from h2.errors import ErrorCodes
from h2.settings import SettingCodes
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from enginelink.runtime.engine.model_dir import load_tokenizer, read_model_facts
from tests.grpc_pair import grpc_pair
from tests.harness import generate_request

STREAMS = 24
MAX_TOKENS = 300
STREAM_WINDOW = 256
CONNECTION_WINDOW = 1024  # topped up to this once the initial 65535 is spent
PROMPTS = [[5 + i, 7, 11 + i, 13] for i in range(STREAMS // 3)]  # every third stream shares a prompt
RESET_AFTER_MESSAGES = 5
WAIT_S = 30.0  # bound on any one wait for a condition (generous: two cores, many engineers)
GENERATE = "/vllm.grpc.engine.VllmEngine/Generate"


@pytest.fixture(scope="module")
def model(test_model_dir):
    facts = read_model_facts(test_model_dir)
    return facts, load_tokenizer(facts.tokenizer_path)


class Stream:
    def __init__(self, stream_id: int, prompt_index: int) -> None:
        self.stream_id = stream_id
        self.prompt_index = prompt_index
        self.headers: dict[str, str] = {}
        self.trailers: dict[str, str] = {}
        self.data = bytearray()
        self.ended = False
        self.reset_by_client = False
        self.reset_by_server = False

    def messages(self) -> list[pb.GenerateResponse]:
        out, data = [], bytes(self.data)
        while len(data) >= 5:
            compressed, length = struct.unpack(">?I", data[:5])
            assert not compressed
            if len(data) < 5 + length:
                break  # a message cut by a reset
            out.append(pb.GenerateResponse.FromString(data[5 : 5 + length]))
            data = data[5 + length :]
        return out

    def outcome(self) -> tuple:
        """What the client saw, with chunk boundaries and the complete's repeat of the last delta taken out."""
        tokens, completes = [], []
        for message in self.messages():
            kind = message.WhichOneof("response")
            if kind == "chunk":
                assert not completes, "a chunk after the complete"
                tokens += list(message.chunk.token_ids)
            else:
                complete = pb.GenerateComplete()
                complete.CopyFrom(message.complete)
                del complete.output_ids[:]
                # Prefix-cache hits depend on which of a prompt's three calls the engine scheduled first.
                complete.ClearField("cached_tokens")
                completes.append(complete.SerializeToString(deterministic=True))
        return tokens, completes


class RawClient:
    """An h2 client over a trio socket that grants windows as told and can stop reading."""

    def __init__(self, sock: trio.SocketStream) -> None:
        self.sock = sock
        self.send_lock = trio.Lock()  # the reader and the test both send
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        self.conn.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW})
        self.streams: dict[int, Stream] = {}
        self.reading = trio.Event()
        self.reading.set()
        self.granting = True
        self.owed: dict[int | None, int] = {}  # bytes received but not yet granted back, while not granting
        self.pings_acked = 0
        self.changed = trio.Event()  # set on every batch of events read
        self.on_message = None  # called with (stream) after each DATA frame

    async def flush(self) -> None:
        async with self.send_lock:
            data = self.conn.data_to_send()
            if data:
                await self.sock.send_all(data)

    async def start(self, request: pb.GenerateRequest, prompt_index: int) -> Stream:
        stream_id = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream_id, [
            (":method", "POST"), (":scheme", "http"), (":path", GENERATE), (":authority", "127.0.0.1"),
            ("content-type", "application/grpc"), ("te", "trailers"),
        ])  # fmt: skip
        body = request.SerializeToString()
        self.conn.send_data(stream_id, struct.pack(">?I", False, len(body)) + body, end_stream=True)
        stream = self.streams[stream_id] = Stream(stream_id, prompt_index)
        await self.flush()
        return stream

    async def reset(self, stream: Stream) -> None:
        stream.reset_by_client = True
        self.conn.reset_stream(stream.stream_id, ErrorCodes.CANCEL)
        await self.flush()

    async def ping(self) -> None:
        """Send a PING and wait for its ACK: the server has answered everything before it."""
        before = self.pings_acked
        self.conn.ping(b"fastpath")
        await self.flush()
        await self.wait(lambda: self.pings_acked > before, "the PING's ACK")

    def _grant(self, stream_id: int | None, length: int) -> None:
        if stream_id is not None:
            h2_stream = self.conn.streams.get(stream_id)  # h2's state: events of one read may have closed it
            if h2_stream is not None and not h2_stream.closed:
                self.conn.increment_flow_control_window(length, stream_id=stream_id)
            return
        # The connection: nothing back until the first 64 KiB are spent, then topped up to CONNECTION_WINDOW.
        window = self.conn.inbound_flow_control_window
        if window < CONNECTION_WINDOW:
            self.conn.increment_flow_control_window(CONNECTION_WINDOW - window)

    def start_granting(self) -> None:
        self.granting = True
        owed, self.owed = self.owed, {}
        for stream_id, length in owed.items():
            self._grant(stream_id, length)
        self._grant(None, 0)

    async def read_forever(self) -> None:
        while True:
            await self.reading.wait()
            data = await self.sock.receive_some(1 << 16)
            if not data:
                return
            for event in self.conn.receive_data(data):  # h2 raises on a DATA frame beyond a window granted
                self._apply(event)
            await self.flush()
            self.changed.set()
            self.changed = trio.Event()

    def _apply(self, event) -> None:
        stream = self.streams.get(getattr(event, "stream_id", None) or -1)
        match event:
            case h2.events.ResponseReceived(headers=headers) if stream:
                stream.headers = dict(headers)
            case h2.events.TrailersReceived(headers=headers) if stream:
                stream.trailers = dict(headers)
            case h2.events.DataReceived(data=data, flow_controlled_length=length, stream_id=stream_id):
                if stream is not None and not stream.reset_by_client:
                    stream.data += data
                if self.granting:
                    self._grant(stream_id, length)
                    self._grant(None, length)
                else:
                    self.owed[stream_id] = self.owed.get(stream_id, 0) + length
                if stream is not None and self.on_message is not None:
                    self.on_message(stream)
            case h2.events.StreamEnded() if stream:
                stream.ended = True
            case h2.events.StreamReset() if stream:
                stream.reset_by_server = not stream.reset_by_client
            case h2.events.PingAckReceived():
                self.pings_acked += 1
            case h2.events.ConnectionTerminated():
                raise AssertionError(f"the server closed the connection: {event}")

    async def wait(self, predicate, what: str) -> None:
        with trio.fail_after(WAIT_S):
            while not predicate():
                changed = self.changed
                with trio.move_on_after(0.05):  # the server's side changes without the client reading
                    await changed.wait()

    def window_view(self) -> tuple[int, dict[int, int]]:
        """What the client granted minus what it received: the server's outbound windows, once nothing is in flight."""
        conn = self.conn
        streams = {sid: s.inbound_flow_control_window for sid, s in conn.streams.items() if not s.closed}
        return conn.inbound_flow_control_window, streams


def server_view(pair) -> tuple[int, dict[int, int]]:
    (state,) = pair.flow_states()
    return state.connection_window, state.stream_windows


async def run_scenario(model, scenario: str, *, fast_path: bool) -> dict:
    facts, tokenizer = model
    async with grpc_pair(facts, tokenizer, fast_path=fast_path) as pair:
        sock = await trio.open_tcp_stream("127.0.0.1", pair.port)
        client = RawClient(sock)
        await client.flush()
        checks: dict = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.read_forever)
            to_reset: list[Stream] = []
            if scenario == "stalled_reader":
                client.granting = False  # what arrives after the first frames is not granted back until resumed
            if scenario == "reset":

                def on_message(stream: Stream) -> None:
                    if (stream.stream_id // 2) % 3 == 2 and not stream.reset_by_client and stream not in to_reset \
                            and len(stream.messages()) >= RESET_AFTER_MESSAGES:
                        to_reset.append(stream)

                client.on_message = on_message
            for index in range(STREAMS):
                request = generate_request(f"{scenario}-{index}", PROMPTS[index % len(PROMPTS)], stream=True,
                                           max_tokens=MAX_TOKENS, ignore_eos=True, seed=7)  # fmt: skip
                await client.start(request, index % len(PROMPTS))
            streams = list(client.streams.values())
            if scenario == "stalled_reader":
                # The server spends every credit it has while nobody grants more: stop reading once it has.
                await client.wait(lambda: all(s.data for s in streams), "data on every stream")
                client.reading = trio.Event()

                def spent() -> bool:
                    window, per_stream = server_view(pair)
                    return window == 0 or all(w == 0 for w in per_stream.values())

                await client.wait(spent, "the server spending its credit")
                await client.wait(lambda: not pair.hub.by_engine_id, "the engine ending every call")
                client.reading.set()
                await client.ping()
                checks["stalled"] = (server_view(pair), client.window_view())
                client.start_granting()
                await client.flush()
            if scenario == "reset":
                reset_done: set[int] = set()

                def resets_due() -> bool:
                    return len(to_reset) > len(reset_done) or all(s.ended or s.reset_by_client for s in streams)

                while not all(s.ended or s.reset_by_client for s in streams):
                    await client.wait(resets_due, "a stream to reset or the end")
                    for stream in to_reset:
                        if stream.stream_id not in reset_done:
                            reset_done.add(stream.stream_id)
                            await client.reset(stream)
                checks["resets"] = len(reset_done)
            await client.wait(lambda: all(s.ended or s.reset_by_client or s.reset_by_server for s in streams),
                              "every stream's end")  # fmt: skip
            await client.wait(lambda: pair.flow_states()[0].grpclib_streams == 0 and not pair.hub.calls,
                              "grpclib and the hub releasing every call")  # fmt: skip
            await client.ping()
            (state,) = pair.flow_states()
            checks["end"] = ((state.connection_window, state.stream_windows), client.window_view())
            checks["left"] = (state.open_streams, state.grpclib_streams, len(pair.hub.calls))
            checks["direct_writes"] = pair.hub.direct_writes
            nursery.cancel_scope.cancel()
        await sock.aclose()
    checks["streams"] = {
        s.stream_id: (s.prompt_index, s.headers, s.trailers, s.outcome(), s.reset_by_client, s.reset_by_server)
        for s in streams
    }
    return checks


@pytest.mark.parametrize("scenario", ["small_windows", "stalled_reader", "reset"])
async def test_the_fast_path_and_grpclibs_own_agree(model, scenario):
    runs = {fast: await run_scenario(model, scenario, fast_path=fast) for fast in (True, False)}
    on, off = runs[True], runs[False]
    # Each way: the server's windows are what the client granted minus what it got, and nothing is left.
    for fast, run in runs.items():
        server, client = run["end"]
        assert server == client, f"fast path {fast}: server windows {server} != client's view {client}"
        assert client[1] == {}, f"fast path {fast}: streams still open at the end: {client[1]}"
        assert run["left"] == (0, 0, 0), f"fast path {fast}: (h2 open streams, grpclib streams, hub calls) left"
        if "stalled" in run:
            server, client = run["stalled"]
            assert server == client, f"fast path {fast}, reader stalled: server {server} != client {client}"
            window, per_stream = server
            assert window == 0 or all(w == 0 for w in per_stream.values()), f"credit left unused: {server}"
    assert on["direct_writes"] > 0 and off["direct_writes"] == 0  # each run took the path it names
    assert on["end"][0][0] == off["end"][0][0]  # the same connection window at the end
    if scenario == "reset":
        assert on["resets"] == off["resets"] > 0
    # Per stream (stream ids are the same both ways: the client opens them in order).
    assert on["streams"].keys() == off["streams"].keys()
    full: dict[int, list[int]] = {}
    for run in (on, off):
        for prompt, headers, trailers, (tokens, completes), reset_by_client, reset_by_server in run["streams"].values():
            assert not reset_by_server
            if not reset_by_client:
                assert len(tokens) == MAX_TOKENS and len(completes) == 1
                assert full.setdefault(prompt, tokens) == tokens  # one prompt, one greedy answer, both ways
    for stream_id, (prompt, headers, trailers, (tokens, completes), reset, _) in on["streams"].items():
        other = off["streams"][stream_id]
        assert headers == other[1] and headers[":status"] == "200", (stream_id, headers, other[1])
        if reset:
            assert other[4], f"stream {stream_id} reset one way only"
            assert tokens == full[prompt][: len(tokens)] and other[3][0] == full[prompt][: len(other[3][0])]
            continue
        assert trailers == other[2] and trailers.get("grpc-status") == "0", (stream_id, trailers, other[2])
        assert (tokens, completes) == other[3], f"stream {stream_id}: messages differ"
