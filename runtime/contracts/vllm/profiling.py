"""StartProfile / StopProfile: the engine's own profiler, as smg contract §10 says.

vLLM's profiler is configured when the engine is launched
(``--profiler-config``), so a request that sets any option is refused with
INVALID_ARGUMENT; otherwise the engine's ``profile`` utility is called, at
most ``PROFILE_CALL_CAP_S``. An engine launched without a profiler refuses,
and the caller gets FAILED_PRECONDITION (the engine is not set up for it;
nothing in the request can fix that, and it is no bug of ours) with the
engine's own words ("Profiling is not enabled. Please set --profiler-config
...") and how to launch it with one. (The reference servicer answers INTERNAL.)
"""

from __future__ import annotations

from typing import Final

from grpclib.const import Status
from grpclib.exceptions import GRPCError
from smg_grpc_proto.generated import common_pb2 as pb

PROFILE_CALL_CAP_S: Final = 600.0
_OPTIONS = ("output_dir", "start_step", "num_steps", "with_stack", "record_shapes")


def check_start_options(request: pb.StartProfileRequest) -> None:
    """Raise INVALID_ARGUMENT when the request sets a per-request option."""
    named = [name for name in _OPTIONS if request.HasField(name)]
    if request.activities:
        named.append("activities")
    if request.profile_by_stage:
        named.append("profile_by_stage")
    if named:
        raise GRPCError(
            Status.INVALID_ARGUMENT,
            f"{', '.join(named)}: vLLM's profiler is configured when the engine is launched "
            "(--profiler-config); StartProfile takes no options",
        )


async def profile(link, start: bool) -> pb.ProfileResponse:
    """Start or stop the engine's profiler (trio); raises GRPCError with the status to answer."""
    from enginelink.runtime.engine.engine_link import LinkFailed

    if not link.machine.live or not link.ready:
        raise GRPCError(Status.UNAVAILABLE, "engine is not up; retry later")
    try:
        await link.utility("profile", [start, None, None, None], PROFILE_CALL_CAP_S)
    except LinkFailed as error:
        if "did not answer" in str(error):
            raise GRPCError(Status.DEADLINE_EXCEEDED, str(error)) from None
        if str(error).startswith("engine refused"):  # EngineLink.utility: the engine's own failure reply
            raise GRPCError(
                Status.FAILED_PRECONDITION,
                f"{error} (the profiler is configured when the engine is launched: pass vLLM's "
                "--profiler-config to the engine, after `--` on the enginelink serve command line)",
            ) from None
        raise GRPCError(Status.UNAVAILABLE, f"{error}; retry later") from None
    return pb.ProfileResponse(success=True, message=f"{'Start' if start else 'Stop'} profiling succeeded")
