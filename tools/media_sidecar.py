"""``enginelink media-sidecar``: the GPU-free media sidecar for workers under ``--mm-processor redis``.

    enginelink media-sidecar --model DIR --redis-url unix:///run/redis.sock \\
        --allowed-media-domains example.com [-- ENGINE ARGS]

Give it the worker's engine arguments after ``--`` (``--dtype``,
``--limit-mm-per-prompt``, ``--media-io-kwargs``, ``--mm-processor-kwargs``;
images, videos and audio go through vLLM's own loaders built from them):
the worker and its sidecars must agree on them, and the key namespace is
derived from them (``wire/mm_sidecar.py``), so a sidecar given other values
serves nobody rather than the wrong tensors. Run as many as the load needs,
beside one private Redis; each one serves workers of enginelink and of the
reference servicer alike (``runtime/requests/media_sidecar.py`` says how).

Settings as the worker reads them: ``--redis-url`` else
``SMG_VLLM_MM_REDIS_URL``; ``--namespace`` else ``SMG_VLLM_MM_SIDECAR_NAMESPACE``;
the fetch caps and policy (``SMG_VLLM_MM_MAX_ITEM_BYTES``, the fetch
deadlines, ``SMG_MM_ALLOW_PRIVATE_MEDIA_HOSTS``, the video frame cap
``SMG_VLLM_MM_MAX_VIDEO_FRAMES``, read here as the reference's sidecar reads
it, ...) and
``SMG_VLLM_MM_MAX_RESULT_BYTES`` (default 512 MiB, lowered to Redis's own
``proto-max-bulk-len``). A bad value exits 2 naming it. SIGTERM or SIGINT:
no more jobs are taken, those in hand are answered within a few seconds,
exit 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

import trio

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
RESULT_BYTES_ENV = "SMG_VLLM_MM_MAX_RESULT_BYTES"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="the model directory (or id) the workers' engine serves")
    p.add_argument("--redis-url", default=None, help="the private Redis (default: $SMG_VLLM_MM_REDIS_URL, else "
                                                     "redis://127.0.0.1:6379/0; unix:///path.sock for a socket)")
    p.add_argument("--namespace", default=None, help="the key namespace (default: $SMG_VLLM_MM_SIDECAR_NAMESPACE, "
                                                     "else derived from the fingerprint, as the worker derives it)")
    p.add_argument("--concurrency", type=int, default=2, help="jobs taken at once (fetches overlap; the model's "
                                                              "processor takes one at a time) (default 2)")
    p.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="DOMAIN",
                   help="fetch from these domains only (default: $ENGINELINK_ALLOWED_MEDIA_DOMAINS, else any)")
    p.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="accept file: refs under DIR (default: $ENGINELINK_ALLOWED_LOCAL_MEDIA_PATH, else none)")
    p.add_argument("--log-level", default=os.environ.get("ENGINELINK_LOG_LEVEL", "INFO"),
                   help=f"one of {', '.join(LOG_LEVELS)} (default INFO; ENGINELINK_LOG_LEVEL)")
    p.set_defaults(engine_args=[])


class _Refused(Exception):
    pass


def _settings(args: argparse.Namespace):
    """The media settings with this command's flags over the environment's; a bad one is ``_Refused``."""
    from enginelink.runtime.engine.launchers import flag_values
    from enginelink.runtime.contracts.shared.media import ALLOWED_DOMAINS_ENV, MediaKnobError, media_settings_from

    environ = dict(os.environ)
    if args.redis_url is not None:
        environ["SMG_VLLM_MM_REDIS_URL"] = args.redis_url
    if args.namespace is not None:
        environ["SMG_VLLM_MM_SIDECAR_NAMESPACE"] = args.namespace
    domains = args.allowed_media_domains or flag_values(list(args.engine_args), "--allowed-media-domains")
    if domains:
        environ[ALLOWED_DOMAINS_ENV] = ",".join(domains)
    if args.allowed_local_media_path is not None:
        environ["ENGINELINK_ALLOWED_LOCAL_MEDIA_PATH"] = args.allowed_local_media_path
    try:
        settings = media_settings_from(environ)
    except MediaKnobError as error:
        message = str(error)
        for flag, name in (("--redis-url", "SMG_VLLM_MM_REDIS_URL"), ("--namespace", "SMG_VLLM_MM_SIDECAR_NAMESPACE")):
            if getattr(args, flag[2:].replace("-", "_")) is not None and message.startswith(name):
                message = f"{flag} ({name}){message[len(name):]}"  # the flag gave the value: name it
        raise _Refused(message) from None
    if args.concurrency < 1:
        raise _Refused(f"--concurrency {args.concurrency}: must be at least 1")
    text = environ.get(RESULT_BYTES_ENV, "").strip()
    from enginelink.wire.mm_sidecar import DEFAULT_MAX_RESULT_BYTES

    result_max = DEFAULT_MAX_RESULT_BYTES
    if text:
        if not text.isdigit() or int(text) < 1:
            raise _Refused(f"{RESULT_BYTES_ENV}={text!r}: expected a whole number of bytes, at least 1")
        result_max = int(text)
    return settings, result_max


def run(args: argparse.Namespace) -> int:
    level = str(args.log_level).strip().upper()
    if level not in LOG_LEVELS:
        print(f"enginelink media-sidecar: log level {args.log_level!r}: expected one of {', '.join(LOG_LEVELS)}",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from enginelink.runtime.contracts.vllm.launch import default_vllm_python
    from enginelink.runtime.engine.launchers import LauncherError

    try:
        settings, result_max = _settings(args)
        python = default_vllm_python()
    except (_Refused, LauncherError) as error:
        print(f"enginelink media-sidecar: {error}", file=sys.stderr)
        return 2
    return trio.run(_main, args, settings, result_max, python)


async def _main(args: argparse.Namespace, settings, result_max: int, python: str) -> int:
    import trio_asyncio
    from prometheus_client import CollectorRegistry

    from enginelink.runtime.contracts.shared.media import MediaMetrics
    from enginelink.runtime.requests.media_fetch import Fetcher
    from enginelink.runtime.requests.media_processor import MediaProcessor
    from enginelink.runtime.requests.media_redis import RedisLink
    from enginelink.runtime.requests.media_sidecar import Sidecar

    log = logging.getLogger("enginelink.media_sidecar")
    metrics = MediaMetrics(CollectorRegistry(), {}, settings.inflight_max, settings.bytes_in_flight_max,
                           settings=settings)  # fmt: skip
    processor = MediaProcessor(args.model, lambda: python, start_timeout_s=settings.processor_start_timeout_s,
                               process_timeout_s=settings.process_timeout_s, reply_bytes_max=settings.tensor_bytes_max,
                               on_start=metrics.processor_started, engine_args=list(args.engine_args),
                               video_frames_max=settings.video_frames_max)  # fmt: skip
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio_asyncio.open_loop():
            link = RedisLink(settings.redis_url, connections_max=args.concurrency + 4)
            sidecar = Sidecar(link, Fetcher(settings, metrics), processor, settings=settings,
                              namespace=settings.sidecar_namespace, concurrency=args.concurrency,
                              result_bytes_max=result_max)  # fmt: skip
            status = 0
            try:
                async with trio.open_nursery() as nursery:
                    async def serve() -> None:
                        nonlocal status
                        try:
                            await sidecar.run()
                        except Exception as error:  # the helper did not start: nothing to serve with
                            log.error("media sidecar cannot serve: %s", error)
                            status = 1
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(serve)
                    async for signum in signals:
                        log.info("%s: no more jobs taken; those in hand get a few seconds",
                                 signal.Signals(signum).name)  # fmt: skip
                        sidecar.stop_taking()
                        nursery.cancel_scope.cancel()
                        break
            finally:
                with trio.CancelScope(shield=True):
                    await processor.aclose()
                    await link.aclose()
    log.info("media sidecar exiting (%d jobs answered)", sidecar.done)
    return status
