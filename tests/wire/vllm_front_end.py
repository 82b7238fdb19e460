"""Schemas and choices that tell vLLM's front-end rules apart, release by release.

``vllm``'s own ``has_xgrammar_unsupported_json_features`` and
``choice_as_grammar`` answer these in the installed releases' venvs
(``tests/vllm/test_vllm_releases.py``, ``tests/vllm_0_28/``); enginelink's
mirrors (``runtime/requests/constraints.py``) must answer the same for that
release. ``FRONT_END`` is a script run with a vLLM venv's interpreter.
"""

from __future__ import annotations

from enginelink.runtime.requests import constraints

SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}},
    {"type": "integer", "multipleOf": 3},
    {"type": ["integer", "null"], "multipleOf": 3},
    {"type": "array", "uniqueItems": True},
    {"type": "string", "format": "email"},
    {"type": "string", "format": "credit-card"},
    {"type": "string", "pattern": "a+", "maxLength": 3},
    {"type": "string", "format": "date", "minLength": 1},
    {"type": "object", "propertyNames": {"pattern": "^a"}},
    {"type": "object", "propertyNames": {"pattern": "^a", "maxLength": 4}},
    {"type": "object", "propertyNames": {"pattern": "^a"}, "properties": {"ab": {}}},
    {"type": "object", "propertyNames": {"pattern": "^a"}, "additionalProperties": {"type": "string"}},
    {"type": "object", "propertyNames": {"pattern": "^a"}, "unevaluatedProperties": False},
    {"type": "object", "patternProperties": {"^a": {}}},
    {"type": "object", "patternProperties": {"^a": {}, "^b": {}}},
    {"type": "object", "patternProperties": {"^a": {}}, "properties": {"b": {}}},
    {"allOf": [{"type": "string"}, {"enum": ["a", "b"]}]},
    {"type": "object", "properties": {"x": {"type": "array", "items": {"type": "number", "multipleOf": 2}}}},
]
CHOICES = [["yes", "no"], ['say "hi"', "back\\slash"], ["line\nbreak", "tab\there", "nul\x00", "del\x7f"]]

FRONT_END = """
import json, sys
from vllm.v1.structured_output.backend_xgrammar import has_xgrammar_unsupported_json_features
from vllm.v1.structured_output.utils import choice_as_grammar
schemas, choices = json.loads(sys.argv[1])
print(json.dumps([[has_xgrammar_unsupported_json_features(s) for s in schemas],
                  [choice_as_grammar(c) for c in choices]]))
"""


def ours(release: str) -> list:
    """enginelink's answers for ``release``, as ``FRONT_END`` prints vLLM's."""
    minor = constraints.vllm_minor(release)
    return [[constraints._xgrammar_unsupported(s, minor) for s in SCHEMAS],
            [constraints.choice_as_grammar(c, minor) for c in CHOICES]]
