"""``enginelink make-test-model [DIR]``: the command around the two model builders.

The text model (``test_model.py``, pure Python, what ``enginelink serve`` builds
on first use) by default; ``--vision`` the vision-language model
(``test_vision_model.py``), ``--video`` / ``--audio`` the video and audio
models (``test_media_models.py``), built by the vLLM venv's interpreter. Its
own module so that no builder imports the command (the vision and media
builders stand on the text model).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from enginelink.tools import test_model
from enginelink.tools.test_media_models import make_media_model
from enginelink.tools.test_vision_model import make_vision_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, metavar="DIR", nargs="?", default=None,
                        help="where to write the model directory (default: the one `enginelink serve` uses, "
                             "test-model under the state dir, $XDG_STATE_HOME/enginelink on Linux)")
    parser.add_argument("--force", action="store_true", help="rebuild even if DIR exists")
    parser.add_argument("--vision", action="store_true",
                        help="build the tiny vision-language model instead (BLIP-2 on the text model's shape; "
                             "needs the vLLM venv's torch and transformers: tools/test_vision_model.py); DIR required")
    parser.add_argument("--video", action="store_true",
                        help="build the tiny video model instead (Qwen3-VL; tools/test_media_models.py); DIR required")
    parser.add_argument("--audio", action="store_true",
                        help="build the tiny audio model instead (Qwen2-Audio; tools/test_media_models.py); DIR "
                             "required")
    parser.add_argument("--hub-id", default=None, metavar="ORG/NAME",
                        help="also file the model in the Hugging Face cache as this Hub id's snapshot on main, so "
                             "`enginelink serve --model ORG/NAME` (or `vllm serve ORG/NAME`) finds it offline; "
                             "prints the snapshot's path")
    parser.add_argument("--hub-cache", type=Path, default=None, metavar="CACHE",
                        help="the Hugging Face cache for --hub-id (default: huggingface_hub's, HF_HUB_CACHE or "
                             "HF_HOME/hub)")
    parser.add_argument("--print-path", action="store_true",
                        help="print DIR (default: the path `enginelink serve` uses) and build nothing, "
                             "e.g. for the router's --model-path")


def run(args: argparse.Namespace) -> int:
    kind = "video" if getattr(args, "video", False) else "audio" if getattr(args, "audio", False) else None
    if kind is not None:
        if args.dir is None:
            print(f"make-test-model: --{kind} needs DIR", file=sys.stderr)
            return 2
        try:
            print(make_media_model(kind, args.dir, force=args.force))
        except (FileExistsError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            print(f"make-test-model: {exc}\n{detail.decode(errors='replace')[-2000:]}", file=sys.stderr)
            return 1
        return 0
    if getattr(args, "vision", False):
        if args.dir is None:
            print("make-test-model: --vision needs DIR", file=sys.stderr)
            return 2
        try:
            print(make_vision_model(args.dir, force=args.force))
        except (FileExistsError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            print(f"make-test-model: {exc}\n{detail.decode(errors='replace')[-2000:]}", file=sys.stderr)
            return 1
        return 0
    out_dir = args.dir if args.dir is not None else test_model.default_test_model_path()
    if args.print_path:
        print(out_dir)
        return 0
    try:
        path = test_model.make_test_model(out_dir, force=args.force)
    except FileExistsError as exc:
        print(f"make-test-model: {exc}", file=sys.stderr)
        return 1
    if getattr(args, "hub_id", None):
        from huggingface_hub import constants
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(args.hub_id)
        except HFValidationError as exc:
            print(f"make-test-model: --hub-id {args.hub_id!r}: {exc}", file=sys.stderr)
            return 2
        path = test_model.place_in_hub_cache(path, args.hub_cache or Path(constants.HF_HUB_CACHE), args.hub_id)
    print(path)
    return 0
