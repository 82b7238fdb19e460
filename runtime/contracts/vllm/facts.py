"""The facts in vLLM's messages: GetModelInfo, GetServerInfo, GetLoads.

From the neutral facts every contract shares (``runtime/context/``: the app,
``ServedModel``, ``RankLoad``), with what is vLLM's own: PD's connector
facts (``kv_transfer.py``), the media processor's (``contracts/shared/media.py``),
its ``server_type``. The service calls these by module attribute
(``facts.model_info``), so a test can put a bug into one.
"""

from __future__ import annotations

from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from enginelink.runtime.context.facts import context_len
from enginelink.runtime.contracts.shared.facts import model_fields, scheduler_load
from enginelink.runtime.contracts.shared.media import media_settings
from enginelink.runtime.contracts.shared.service_common import now_iso
from enginelink.runtime.contracts.vllm import kv_transfer
from enginelink.runtime.requests.embed import RUNNER_POOLING, runner_type
from enginelink.runtime.requests.media_bounds import MediaBounds, media_bounds

SERVER_TYPE = "vllm-grpc"  # GetServerInfo.server_type, as the reference servicer answers


def model_info(app) -> pb.GetModelInfoResponse:
    model = app.model
    max_len = context_len(app)
    return pb.GetModelInfoResponse(
        **model_fields(app),
        # False on a pooling engine (runtime/requests/embed.py): it serves Embed, not Generate.
        is_generation=runner_type(app.ready) != RUNNER_POOLING,
        max_context_length=max_len,
        supports_vision=model.supports_vision,  # router tensors: runtime/contracts/shared/mm_tensors.py
        tokenizer_path=model.tokenizer_path,
        max_req_input_len=max_len,
        default_sampling_params_json=model.default_sampling_params_json,
    )


def server_info(app) -> pb.GetServerInfoResponse:
    ready = app.ready
    return pb.GetServerInfoResponse(
        active_requests=app.hub.active_requests,
        is_paused=False,
        last_receive_timestamp=app.hub.last_receive_wall,
        uptime_seconds=app.uptime_s(),
        server_type=SERVER_TYPE,
        data_parallel_size=app.link.ranks.size,
        kv_cache_dtype=str(ready.get("kv_cache_dtype") or "auto"),
        block_size=int(ready.get("block_size") or 0),
        model_dtype=str(ready.get("dtype") or app.model.dtype or ""),
        max_num_seqs=app.max_num_seqs,
        # PD: the connector, role and engine id the router pairs legs by, from the
        # engine's resolved --kv-transfer-config (its facts), and SMG_PAIRING_PROTOCOL.
        **kv_transfer.server_fields(ready),
        # mm_processor and the schemes fetched, when media refs are on (runtime/contracts/shared/media.py).
        **(app.media.server_fields() if app.media is not None else {}),
        # The engine's media bounds as this worker holds requests to them (runtime/requests/media_bounds.py).
        mm_item_limits=engine_media_bounds(app).label(),
        mm_encoder_budget=engine_media_bounds(app).encoder_budget,
    )


def engine_media_bounds(app) -> MediaBounds:
    items_max = app.media.settings.items_max if app.media is not None else media_settings().items_max
    return media_bounds(app.ready, items_max)


def loads(app) -> pb.GetLoadsResponse:
    ranks = [scheduler_load(pb.SchedulerLoad, load)
             for load in app.loads.rank_loads(app.max_num_seqs, app.kv_capacity_tokens)]
    return pb.GetLoadsResponse(
        timestamp=now_iso(),
        version=str(app.link.ready.get("vllm_version", "")),
        dp_rank_count=len(ranks),
        loads=ranks,
    )
