"""SGLang 0.5.23's own reading of an image request and of a model's vision, run in its struct-only venv.

    SGLANG_VENV/bin/python sglang_mm_peer.py CASES.json RESULTS.json

It imports nothing of enginelink but the headless launch script (by path, as
the real launch runs it: ``image_understanding``). For each case:

- ``request``: our encoded ``TokenizedGenerateReqInput`` frame, decoded by
  SGLang's own ``io_struct.msgpack_decode``, its ``mm_inputs`` prepared by
  the scheduler's own ``MultimodalInputs.from_processor_output`` (it hashes
  the item and sets its pad values), and the prompt's token modalities
  built from the offsets (``build_token_modalities``, which raises on a bad
  range); what came out is reported: each tensor's dtype, shape and values;
- ``vision``: ``image_understanding`` of the server arguments SGLang's own
  parser makes of the argv (its ``ModelConfig.is_image_understandable_model``).
"""

from __future__ import annotations

import base64
import importlib.util
import json
import sys


def _tensor(value) -> dict:
    return {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
            "values": value.flatten().float().tolist()}


def request(case: dict) -> dict:
    from sglang.srt.managers import io_struct
    from sglang.srt.managers.schedule_batch import MultimodalInputs, MultimodalProcessorOutput

    req = io_struct.msgpack_decode(base64.b64decode(case["frame"]))
    mm = req.mm_inputs
    out = {"type": type(req).__name__, "mm_type": type(mm).__name__, "im_token_id": mm.im_token_id}
    item = mm.mm_items[0]
    out["items"] = len(mm.mm_items)
    out["modality"] = item.modality.name
    out["offsets"] = [list(o) for o in item.offsets] if item.offsets is not None else None
    out["feature"] = _tensor(item.feature)
    out["model_specific_data"] = {k: _tensor(v) for k, v in item.model_specific_data.items()}
    prepared = MultimodalInputs.from_processor_output(mm)
    out["prepared_images"] = prepared.contains_image_inputs()
    out["pad_value_set"] = isinstance(prepared.mm_items[0].pad_value, int)
    modalities = MultimodalProcessorOutput.build_token_modalities(list(req.input_ids), mm.mm_items)
    out["token_modalities"] = modalities
    return out


def vision(case: dict) -> dict:
    from sglang.srt.server_args import prepare_server_args

    spec = importlib.util.spec_from_file_location("sglang_headless", case["script"])
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return {"supports_vision": script.image_understanding(prepare_server_args(case["argv"]))}


if __name__ == "__main__":
    cases = json.loads(open(sys.argv[1]).read())
    results = {}
    for case in cases:
        try:
            results[case["id"]] = {"request": request, "vision": vision}[case["op"]](case)
        except Exception as exc:  # reported to the test, which fails naming the case
            results[case["id"]] = {"error": f"{type(exc).__name__}: {exc}"}
    open(sys.argv[2], "w").write(json.dumps(results))
