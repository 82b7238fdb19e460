"""The neutral facts and loads (``runtime/context/``) as a contract's messages: the fields every proto shares.

Each wing builds its own ``GetModelInfoResponse`` / ``SchedulerLoad`` class
(the classes differ per contract; the field names these fill are the same in
every one) and adds what is its own.
"""

from __future__ import annotations

import dataclasses

from enginelink.runtime.context.facts import served_model
from enginelink.runtime.context.loads import RankLoad


def model_fields(app) -> dict:
    """The model directory's facts (``ServedModel``) as keyword arguments of a ``GetModelInfoResponse``."""
    model = served_model(app)
    return {field.name: getattr(model, field.name) for field in dataclasses.fields(model)}


def scheduler_load(message, load: RankLoad, **fields):
    """``load`` as the contract's ``SchedulerLoad`` (``message``, its class); ``fields`` over its own."""
    return message(**{**dataclasses.asdict(load), **fields})
