"""Structured output: what a request's answer must match (applied as a token mask while sampling).

The engine compiles the constraint with xgrammar (Dong et al. 2024, "XGrammar: flexible and
efficient structured generation", the library vLLM and SGLang use) and masks every token that
cannot continue a match before it samples (``engine/output/grammar.py``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_CHOICES = 1024
KINDS = ("json", "json_object", "regex", "choice", "grammar")
# JSON schema keywords the mask cannot enforce (xgrammar compiles them but lets answers through
# that break them): refused, so an answer that "matched" always validates
UNENFORCED_KEYWORDS = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "uniqueItems", "contains",
                       "minContains", "maxContains", "patternProperties")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties", "unevaluatedItems")


@dataclass(frozen=True)
class StructuredOutputParams:
    """One constraint on the generated text; exactly one field is set (vLLM's
    ``StructuredOutputsParams``, the ``guided_*`` fields of its OpenAI server).

    Attributes:
        json: a JSON schema (as JSON text; a dict is serialized): the answer is one JSON value
            valid against it.
        json_object: the answer is one JSON object, any keys (OpenAI's ``json_object``; an array
            or a bare value does not match).
        regex: the answer matches this regular expression (whole answer).
        choice: the answer is exactly one of these strings.
        grammar: an EBNF grammar (xgrammar's GBNF dialect, rule ``root`` first).

    Raises:
        ValueError: none or several fields set, a schema that is not JSON, an empty choice list
            or choice, or more than ``MAX_CHOICES`` choices. A schema, regex or grammar that
            does not compile is refused when the request is submitted.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        if isinstance(self.json, Mapping):
            object.__setattr__(self, "json", json.dumps(self.json))  # key order kept: properties come out in it
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"choice must be a list of strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or len(self.choice) > MAX_CHOICES:
                raise ValueError(f"choice must hold 1 to {MAX_CHOICES} non-empty strings, got {len(self.choice)}")
            if not all(self.choice):
                raise ValueError(f"choice {self.choice.index('')} is empty: choices must be non-empty strings")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a bool, got {self.json_object!r}")
        if self.json is not None:
            try:
                schema = json.loads(self.json)
            except ValueError as error:
                raise ValueError(f"json must be a JSON schema: {error}") from None
            found = unenforced(schema)
            if found is not None:
                raise ValueError(f"json: the schema's {found[0]} (at {found[1]}) cannot be enforced while sampling; "
                                 "drop it and check that part of the answer yourself")
        asked = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(asked) != 1:
            raise ValueError(f"give exactly one of {', '.join(KINDS)}; got {', '.join(asked) or 'none'}")

    @property
    def kind(self) -> str:
        """The field that is set: ``json``, ``json_object``, ``regex``, ``choice`` or ``grammar``."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def to_body(self) -> dict[str, Any]:
        """The one field set, as JSON (``choice`` a list)."""
        value = getattr(self, self.kind)
        return {self.kind: list(value) if self.kind == "choice" else value}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> "StructuredOutputParams":
        """The inverse of :meth:`to_body`.

        Raises:
            ValueError: an unknown key, or what the constructor refuses.
        """
        unknown = set(body) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown structured output field(s): {', '.join(sorted(unknown))}")
        return cls(**body)


def unenforced(schema: Any, path: str = "$") -> tuple[str, str] | None:
    """The first part of a JSON schema the token mask cannot enforce, as ``(what, where)``:
    a keyword of ``UNENFORCED_KEYWORDS``, an ``allOf`` of several schemas, or a ``required``
    name the object's ``properties`` do not define; ``None`` when there is none."""
    if not isinstance(schema, Mapping):
        return None
    keyword = next((k for k in UNENFORCED_KEYWORDS if k in schema), None)
    if keyword is not None:
        return f"'{keyword}'", path
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return "'allOf' of several schemas", path
    properties = schema.get("properties") if isinstance(schema.get("properties"), Mapping) else {}
    missing = [name for name in schema.get("required") or () if name not in properties]
    if missing:
        return f"required {missing[0]!r} (not in its 'properties')", path
    subschemas = [(f"{path}.{key}.{name}", sub) for key in _SUBSCHEMA_MAPS
                  if isinstance(schema.get(key), Mapping) for name, sub in schema[key].items()]
    subschemas += [(f"{path}.{key}[{i}]", sub) for key in _SUBSCHEMA_LISTS
                   if isinstance(schema.get(key), list) for i, sub in enumerate(schema[key])]
    subschemas += [(f"{path}.{key}", schema[key]) for key in _SUBSCHEMAS if key in schema]
    return next((found for where, sub in subschemas if (found := unenforced(sub, where)) is not None), None)
