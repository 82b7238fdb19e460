"""The real engine's KV-event side, run in its struct-only venv (SGLang 0.5.23's or TokenSpeed 0.1.1's).

    ENGINE_VENV/bin/python kv_peer.py {sglang|tokenspeed} cases CASES.msgpack RESULTS.msgpack
    ENGINE_VENV/bin/python kv_peer.py {sglang|tokenspeed} publish ENDPOINT REPLAY_ENDPOINT TOPIC

It imports nothing of enginelink. ``cases`` answers, with the engine's own
code, for each case:

- ``config``: what the engine's ``EventPublisherFactory.create`` makes of a
  ``--kv-events-config`` text (the publisher kind it picks, the keyword
  arguments it would give the publisher), its registry's constructors
  replaced by recorders so nothing binds;
- ``decode``: the engine's own ``msgspec`` decoder of ``KVEventBatch``
  (what its consumers use) reads our bytes; is the result equal to the
  engine's batch built from the same fields?
- ``encode``: the engine's batch built from the fields, encoded as its
  publisher thread does (``msgspec.msgpack.Encoder()``).

``publish`` runs the engine's own ``ZmqEventPublisher`` (its PUB, its replay
ROUTER, its thread) on the given endpoints: each stdin line ``N`` publishes N
batches (batch ``seq`` stores block ``seq + 1``, tokens ``[seq] * 4``), then
prints ``published SEQ`` once its queue is empty; end of input shuts it down.
"""

from __future__ import annotations

import sys
import time

import msgspec


def _module(engine: str):
    if engine == "sglang":
        from sglang.srt.disaggregation import kv_events
    else:
        from tokenspeed.runtime.pd import kv_events
    return kv_events


def _event(kv_events, fields: dict):
    fields = dict(fields)
    return getattr(kv_events, fields.pop("type"))(**fields)


def _batch(kv_events, fields: dict):
    return kv_events.KVEventBatch(ts=fields["ts"], events=[_event(kv_events, e) for e in fields["events"]],
                                  attn_dp_rank=fields.get("attn_dp_rank"))


def _config(kv_events, text: str) -> dict:
    made: dict = {}

    def recorder(kind):
        def make(**kwargs):
            made.update(kind=kind, kwargs=kwargs)
            return object()
        return make

    factory = kv_events.EventPublisherFactory
    saved = dict(factory._registry)
    try:
        for kind in saved:
            factory._registry[kind] = recorder(kind)
        publisher = factory.create(text, attn_dp_rank=0)
    finally:
        factory._registry.clear()
        factory._registry.update(saved)
    if not made:  # the factory built its null publisher itself, without the registry
        made = {"kind": "null" if isinstance(publisher, kv_events.NullEventPublisher) else "?", "kwargs": {}}
    return made


def cases(engine: str, cases_path: str, results_path: str) -> None:
    kv_events = _module(engine)
    decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
    encoder = msgspec.msgpack.Encoder()
    results = {}
    for case in msgspec.msgpack.decode(open(cases_path, "rb").read()):
        try:
            if case["op"] == "config":
                results[case["id"]] = _config(kv_events, case["text"])
            elif case["op"] == "decode":
                got = decoder.decode(case["payload"])
                expected = _batch(kv_events, case["fields"])
                results[case["id"]] = {"equal": got == expected, "got": repr(got), "expected": repr(expected)}
            else:
                results[case["id"]] = {"payload": encoder.encode(_batch(kv_events, case["fields"]))}
        except Exception as exc:  # reported to the test, which fails naming the case
            results[case["id"]] = {"error": f"{type(exc).__name__}: {exc}"}
    open(results_path, "wb").write(msgspec.msgpack.encode(results))


def publish(engine: str, endpoint: str, replay_endpoint: str, topic: str) -> None:
    kv_events = _module(engine)
    publisher = kv_events.ZmqEventPublisher(attn_dp_rank=0, endpoint=endpoint, replay_endpoint=replay_endpoint,
                                            topic=topic)
    print("ready", flush=True)
    seq = 0
    for line in sys.stdin:
        for _ in range(int(line)):
            stored = kv_events.BlockStored(block_hashes=[seq + 1], parent_block_hash=seq or None,
                                           token_ids=[seq] * 4, block_size=4,
                                           **({"lora_id": None} if engine == "sglang" else {}))
            publisher.publish(kv_events.KVEventBatch(ts=time.time(), events=[stored]))
            seq += 1
        while not publisher._event_queue.empty():
            time.sleep(0.01)
        time.sleep(0.05)  # the thread's send after its get
        print(f"published {seq - 1}", flush=True)
    publisher.shutdown()


if __name__ == "__main__":
    if sys.argv[2] == "cases":
        cases(sys.argv[1], sys.argv[3], sys.argv[4])
    else:
        publish(sys.argv[1], *sys.argv[3:6])
