"""Profile dataclasses <-> the plain document stored in YAML, derived from the fields' declarations.

`profile_to_dict` writes every field in declaration order (see `kvtool.profiles.fields`);
`profile_from_document` reverses it and trusts its input: `kvtool.profiles.validate` has checked it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from kvtool.profiles.fields import DocField, document_fields
from kvtool.profiles.schema import Profile


class FlowList(list):  # type: ignore[type-arg]
    """A list written on one line (`[0.1, 0.2]`): long columns of floats are unreadable."""


class FlowDict(dict):  # type: ignore[type-arg]
    """A small nested record written on one line (`{tokens: 64, rounds: 2}`)."""


def profile_to_dict(profile: Profile) -> dict[str, Any]:
    """The profile as the plain document stored in YAML (and printed by `inspect --json`)."""
    return _record_to_dict(Profile, profile)


def profile_from_document(document: Mapping[str, Any]) -> Profile:
    return _record_from_dict(Profile, document)


# --------------------------------------------------------------------------- dataclasses -> document


def _record_to_dict(cls: type, record: Any) -> dict[str, Any]:
    # Attribute errors name the missing field, which is what validate_profile reports for non-profiles.
    document: dict[str, Any] = {}
    for f in document_fields(cls):
        value = getattr(record, f.name)
        if value is None and f.rule.omit_none:
            continue
        if f.rule.omit_default and value == _default(cls, f.name):
            continue
        document[f.name] = _value_to_document(f, value)
    return document


def _default(cls: type, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def _value_to_document(f: DocField, value: Any) -> Any:
    if f.rule.wrap is not None:
        return {f.rule.wrap: value}
    # Scalars go in as they are (validation names a wrong one); a None where a record or list
    # belongs fails below, and validate_profile reports that as "not a kvtool profile".
    if value is None and (f.optional or f.kind in ("str", "int", "float", "bool")):
        return None
    if f.kind == "record":
        document = _record_to_dict(f.record, value)
        return FlowDict(document) if f.rule.flow else document
    if f.kind == "records":
        key = f.rule.index_key
        return [
            {key: i, **_record_to_dict(f.record, entry)} if key else _record_to_dict(f.record, entry)
            for i, entry in enumerate(value)
        ]
    if f.kind == "table":
        return dict(value)
    if f.kind in ("strings", "floats"):
        digits = f.rule.digits
        items = (_rounded(v, digits) for v in value) if digits is not None else value
        return FlowList(items) if f.rule.flow else list(items)
    return value


def _rounded(value: Any, digits: int) -> Any:
    # Non-floats are left as they are so validation can name them instead of crashing here.
    if isinstance(value, float) and math.isfinite(value):
        return round(value, digits)
    return value


# --------------------------------------------------------------------------- document -> dataclasses


def _record_from_dict(cls: type, document: Mapping[str, Any]) -> Any:
    # Absent and null values take the dataclass default; keys that are no field (a record's index,
    # legacy keys) are skipped.
    values = {}
    for f in document_fields(cls):
        value = document.get(f.name)
        if value is not None:
            values[f.name] = _value_from_document(f, value)
    return cls(**values)


def _value_from_document(f: DocField, value: Any) -> Any:
    if f.rule.wrap is not None:
        value = value[f.rule.wrap]
    if f.kind == "float":
        return float(value)  # YAML reads `1` as int; the dataclasses hold floats
    if f.kind == "record":
        return _record_from_dict(f.record, value)
    if f.kind == "records":
        return tuple(_record_from_dict(f.record, entry) for entry in value)
    if f.kind == "table":
        return {int(k): float(v) for k, v in value.items()}
    if f.kind == "floats":
        return tuple(float(v) for v in value)
    if f.kind == "strings":
        return tuple(value)
    return value
