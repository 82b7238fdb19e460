"""PD disaggregation: the KV-transfer params a request carries in and out, and the pairing identity.

What the router sends a worker for a prefill/decode (PD) pair, and what it
needs back, per ``reference/request-features.md`` §6 (the reference
servicer's behaviour, which the router 1.13.0 was built against):

- in: ``GenerateRequest.kv_transfer_params_json`` (a JSON object, preferred)
  or the legacy ``KvTransferParams{remote_host, remote_port}``; the JSON field
  wins when both are set. The params go to the engine verbatim as
  ``sampling_params.extra_args.kv_transfer_params`` (``wire/vllm.py``);
- out: the engine's ``EngineCoreOutput.kv_transfer_params`` becomes the
  complete's ``kv_transfer_params_json``, and the legacy typed message too
  when it has Mooncake's shape (a string host, an int port in range);
- early release: a decode-side request (``do_remote_prefill`` truthy) that the
  servicer refuses after reading its params never reaches the engine, so the
  prefill side would keep its blocks pinned until the connector's lease runs
  out. ``release_params`` says when to tell the engine (the hub sends vLLM's
  pre-aborted ADD, ``abort_immediately``, so the connector's
  ``request_finished`` hook frees them);
- identity: ``GetServerInfo``'s ``kv_connector`` / ``kv_role`` /
  ``kv_engine_id`` from the engine's resolved ``--kv-transfer-config``, a
  ``MultiConnector`` projected onto the child that moves the KV between the
  legs (``server_fields``), so the router can pair legs.

Rules: pure functions, no I/O. A client's bad params are ``ClientError``
(INVALID_ARGUMENT) naming the field; sizes and nesting are bounded by
``runtime/requests/inputs.py``'s ``ENGINELINK_MAX_KV_TRANSFER_PARAMS_BYTES`` and
``ENGINELINK_MAX_JSON_DEPTH`` before anything else looks at them.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from enginelink.runtime.errors import ClientError
from enginelink.runtime.requests.inputs import InputLimits, parse_json, utf8_len

log = logging.getLogger("enginelink.kv_transfer")

PORT_MAX = 65535
# The operator-set pairing protocol the reference reads from the engine's
# environment; a prefill and a decode that both carry one pair only when equal.
PAIRING_PROTOCOL_ENV = "SMG_PAIRING_PROTOCOL"

# Connector families, as the router's pairing table knows them
# (request-features.md §6): a P2P connector hands a request's KV to the one
# partner the router names; a store connector's legs meet in a shared store.
MULTI_CONNECTOR = "MultiConnector"
P2P_CONNECTORS = frozenset({"MooncakeConnector", "NixlConnector", "MoRIIOConnector"})
# The router does not drive a MoRI-IO handoff over gRPC: beside exactly one
# store child, the store is the mover it can serve.
MORIIO_CONNECTOR = "MoRIIOConnector"
STORE_CONNECTORS = frozenset({"MooncakeStoreConnector", "SharedStorageConnector"})
STORE_CONNECTOR_PREFIXES = ("FlexKV", "HF3FS")

# The engine facts (runtime/contracts/vllm/vllm_headless.py, the sim engine) that carry the
# resolved KV-transfer config: only names and ids, never the connector's extra
# config (it may hold credentials, and it is journaled with the facts).
FACT_CONNECTOR = "kv_connector"
FACT_ROLE = "kv_role"
FACT_ENGINE_ID = "kv_engine_id"
FACT_CHILDREN = "kv_connector_children"  # MultiConnector: [[kv_connector, engine_id or None], ...]
FACT_ATTENTION_BACKEND = "attention_backend"  # the requested --attention-backend; absent when auto


# -- in ------------------------------------------------------------------------------


def params_from_request(request: pb.GenerateRequest, limits: InputLimits) -> dict | None:
    """The request's KV-transfer params for the engine; None when it carries none.

    The JSON field wins over the legacy message, as in the reference.
    """
    if request.HasField("kv_transfer_params_json"):
        params = parse_json(
            "kv_transfer_params_json", request.kv_transfer_params_json, limits.kv_transfer_params_bytes,
            "ENGINELINK_MAX_KV_TRANSFER_PARAMS_BYTES", limits,
        )
        if not isinstance(params, dict):
            raise ClientError("kv_transfer_params_json", "must be a JSON object")
        return params
    if request.HasField("kv_transfer_params"):
        legacy = request.kv_transfer_params
        host, port = legacy.remote_host, legacy.remote_port
        size = utf8_len(host, limits.kv_transfer_params_bytes)
        if size > limits.kv_transfer_params_bytes:
            raise ClientError(
                "kv_transfer_params.remote_host",
                f"is {size} bytes; at most {limits.kv_transfer_params_bytes} (ENGINELINK_MAX_KV_TRANSFER_PARAMS_BYTES)",
            )
        if not host or not 1 <= port <= PORT_MAX:
            raise ClientError(
                "kv_transfer_params", f"remote_host must be set and remote_port must be in [1, {PORT_MAX}]"
            )
        return {"remote_host": host, "remote_port": port}
    return None


def params_for_release(request: pb.GenerateRequest, limits: InputLimits) -> dict | None:
    """The params of a refused request whose prefill side holds KV for it; None otherwise.

    A decode-side request (``do_remote_prefill`` truthy) names KV the prefill
    side computed and keeps pinned until the decode side pulls it or the
    connector's lease expires. When the servicer refuses such a request, the
    engine must still see it, pre-aborted, so its connector frees those blocks
    at once (vLLM's ``notify_kv_transfer_request_rejected``). Params that are
    themselves unreadable name no KV to release.
    """
    try:
        params = params_from_request(request, limits)
    except ClientError:
        return None
    if params is None or not params.get("do_remote_prefill"):
        return None
    return params


# -- out -----------------------------------------------------------------------------


def fill_complete(complete: pb.GenerateComplete, params: Mapping[str, Any] | None) -> None:
    """Put the engine's KV-transfer params on a complete: the JSON field, and the legacy message when it fits."""
    if not params:
        return
    try:
        complete.kv_transfer_params_json = json.dumps(params)
    except (TypeError, ValueError) as error:
        # The engine's connector put something JSON cannot hold (bytes, say): the
        # router could not read it either. Dropped with a warning, as the reference does.
        log.warning("dropping the engine's kv_transfer_params: not JSON-serializable (%s)", error)
    host, port = params.get("remote_host"), params.get("remote_port")
    if isinstance(host, str) and host and isinstance(port, int) and not isinstance(port, bool) and 1 <= port <= PORT_MAX:
        complete.kv_transfer_params.remote_host = host
        complete.kv_transfer_params.remote_port = port


# -- identity ------------------------------------------------------------------------


def _is_store(connector: str) -> bool:
    return connector in STORE_CONNECTORS or connector.startswith(STORE_CONNECTOR_PREFIXES)


def resolve_connector(connector: str, engine_id: str, children: Any) -> tuple[str, str]:
    """The connector and engine id the router should pair on.

    A ``MultiConnector`` stands for the child that moves KV between the legs:
    its one P2P child, else its one store child; a MoRI-IO child gives way to
    a single store child beside it. The child's engine id, else the parent's.
    A wrapper whose children are malformed, or hold no such child or two of a
    kind, is reported as itself, so the router does not guess a protocol.
    """
    if connector != MULTI_CONNECTOR or not isinstance(children, list):
        return connector, engine_id
    p2p, store = [], []
    for child in children:
        if not (isinstance(child, list) and len(child) == 2 and isinstance(child[0], str) and child[0]):
            return connector, engine_id
        if child[0] in P2P_CONNECTORS:
            p2p.append(child)
        elif _is_store(child[0]):
            store.append(child)
    if len(p2p) == 1:
        mover = p2p[0]
        if mover[0] == MORIIO_CONNECTOR and store:
            if len(store) != 1:
                return connector, engine_id
            mover = store[0]
    elif not p2p and len(store) == 1:
        mover = store[0]
    else:
        return connector, engine_id
    child_engine_id = mover[1] if mover[1] is not None else engine_id
    if not isinstance(child_engine_id, str) or not child_engine_id:
        return connector, engine_id
    return mover[0], child_engine_id


def server_fields(facts: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``GetServerInfoResponse``'s PD fields from the engine's facts ("" when PD is not configured)."""
    connector = str(facts.get(FACT_CONNECTOR) or "")
    engine_id = str(facts.get(FACT_ENGINE_ID) or "")
    if connector:
        connector, engine_id = resolve_connector(connector, engine_id, facts.get(FACT_CHILDREN))
    source = os.environ if environ is None else environ
    return {
        "kv_connector": connector,
        "kv_role": str(facts.get(FACT_ROLE) or "") if connector else "",
        "kv_engine_id": engine_id if connector else "",
        "attention_backend": str(facts.get(FACT_ATTENTION_BACKEND) or ""),
        "pairing_protocol": (source.get(PAIRING_PROTOCOL_ENV) or "").strip(),
    }
