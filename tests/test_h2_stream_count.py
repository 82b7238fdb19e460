"""The server's h2 connection counts open streams without walking them all for each new one
(``fastpath.StreamCountH2Connection``), and answers every byte exactly as h2's own connection does.

h2 walks every stream a connection tracks each time the peer opens one (to hold
SETTINGS_MAX_CONCURRENT_STREAMS), so n calls on one connection cost O(n²). Ours must still
refuse the same streams at the same moment, send the same bytes and give the same events; the
scenarios below drive both with the same client bytes, past the limit and back, with streams
ending every way a stream ends.
"""

from __future__ import annotations

import random

import h2.config
import h2.connection
import h2.exceptions
import pytest

from enginelink.runtime.rpc.fastpath import STREAM_WALK_AT_LEAST, StreamCountH2Connection

REQUEST = [(":method", "POST"), (":path", "/vllm.grpc.engine.VllmEngine/Generate"), (":scheme", "http"),
           (":authority", "worker"), ("content-type", "application/grpc"), ("te", "trailers")]
RESPONSE = [(":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "0")]
# What a server has as its limit before the client acknowledges its SETTINGS: h2's default.
H2_DEFAULT_LIMIT = 100


def server(kind: type[h2.connection.H2Connection]) -> h2.connection.H2Connection:
    conn = kind(config=h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
    conn.initiate_connection()
    conn.data_to_send()
    return conn


def answer(conn: h2.connection.H2Connection, call) -> tuple:
    """What the connection does with ``call(conn)``: its events (type, stream) or its error, and its bytes."""
    try:
        events = call(conn)
    except h2.exceptions.ProtocolError as error:
        return ("error", type(error).__name__, str(error), conn.data_to_send())
    summary = [(type(event).__name__, getattr(event, "stream_id", None)) for event in events or []]
    return ("ok", summary, conn.data_to_send())


def run_scenario(seed: int, steps: int, peak: int, p_open: float = 0.45) -> tuple[StreamCountH2Connection, int, int]:
    """Random client traffic into both servers; returns ours, the streams opened and the refusals.

    ``peak``: the open streams the client aims to hover around (past h2's limit when above it);
    ``p_open``: how often a step opens a stream (the rest end, reset or answer one).
    """
    rng = random.Random(seed)
    client = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    theirs, ours = server(h2.connection.H2Connection), server(StreamCountH2Connection)
    preface = client.data_to_send()
    assert answer(theirs, lambda c: c.receive_data(preface)) == answer(ours, lambda c: c.receive_data(preface))
    client_open: list[int] = []  # streams the client may still send on
    server_open: list[int] = []  # streams the server may still answer
    opened = refusals = 0
    next_id = 1
    sid = 0
    for _ in range(steps):
        roll = rng.random()
        if roll < p_open or not (client_open or server_open):
            want_more = len(client_open) + len(server_open) < peak
            if not want_more and rng.random() < 0.7:
                continue
            sid, next_id = next_id, next_id + 2
            ends = rng.random() < 0.6
            client.send_headers(sid, REQUEST, end_stream=ends)
            opened += 1
            (server_open if ends else client_open).append(sid)
        elif roll < p_open + 0.15 and client_open:
            sid = client_open.pop(rng.randrange(len(client_open)))
            client.send_data(sid, b"\x00\x00\x00\x00\x00", end_stream=True)
            server_open.append(sid)
        elif roll < p_open + 0.25 and (client_open or server_open):
            pool = client_open if client_open and rng.random() < 0.5 else server_open or client_open
            sid = pool.pop(rng.randrange(len(pool)))
            client.reset_stream(sid)
        elif server_open:
            sid = server_open.pop(rng.randrange(len(server_open)))
            mine = answer(ours, lambda c: c.send_headers(sid, RESPONSE, end_stream=True))
            assert mine == answer(theirs, lambda c: c.send_headers(sid, RESPONSE, end_stream=True)), sid
            continue
        data = client.data_to_send()
        mine = answer(ours, lambda c: c.receive_data(data))
        assert mine == answer(theirs, lambda c: c.receive_data(data))
        if mine[:2] == ("error", "TooManyStreamsError"):
            refusals += 1  # the stream just opened: the server never made it
            for pool in (client_open, server_open):
                if sid in pool:
                    pool.remove(sid)
    return ours, opened, refusals


@pytest.mark.parametrize("seed", [1, 2])
def test_below_the_limit_the_answers_are_h2s_and_the_table_is_walked_rarely(seed):
    ours, opened, refusals = run_scenario(seed, steps=1500, peak=40)
    assert opened > 400 and refusals == 0
    # h2 walks once per new stream; ours once per doubling of the table.
    assert ours.walks < opened / 10, (ours.walks, opened)
    # Closed streams still leave h2's table: it stays within twice the open streams.
    assert len(ours.streams) <= max(STREAM_WALK_AT_LEAST, 2 * ours.exact_open_streams()) + 1


@pytest.mark.parametrize("seed", [4, 5])
def test_past_the_limit_the_same_streams_are_refused_at_the_same_moment(seed):
    ours, opened, refusals = run_scenario(seed, steps=1500, peak=H2_DEFAULT_LIMIT + 5, p_open=0.52)
    assert opened > 400
    assert refusals > 0, "the scenario never reached h2's limit: it tests nothing past it"
    print(f"seed {seed}: {opened} streams opened, {refusals} refused past the limit, {ours.walks} walks")


def test_the_exact_count_is_h2s():
    ours = server(StreamCountH2Connection)
    client = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    for sid in range(1, 21, 2):
        client.send_headers(sid, REQUEST, end_stream=True)
    client.reset_stream(3)
    ours.receive_data(client.data_to_send())
    ours.send_headers(5, RESPONSE, end_stream=True)
    assert ours.exact_open_streams() == 8  # ten opened, one reset by the client, one answered
    assert ours.open_inbound_streams >= 8  # an upper bound below the limit
