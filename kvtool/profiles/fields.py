"""How a profile dataclass field appears in the YAML document: declared once, read by io and validate.

Each field of the profile dataclasses says what the file may hold for it through `rule(...)` in its
metadata; its type hint says the kind (string, integer, number, flag, nested record, list, table),
whether null is allowed (`X | None`), and its default says whether the file may leave it out. The
document lists the fields in declaration order. `document_fields` turns all that into `DocField`s,
which the writer, the reader and the validator all walk.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass
from typing import Any

RULE_KEY = "kvtool.document"


@dataclass(frozen=True)
class Rule:
    """Constraints and layout of one field; every attribute is optional."""

    low: float | None = None  # numbers and integers: lower bound (inclusive unless open_low)
    high: float | None = None  # numbers: upper bound (inclusive)
    open_low: bool = False
    choices: tuple[str, ...] = ()  # strings: the allowed names
    required: bool = False  # required in a file although the dataclass has a default
    nullable: bool = False  # null accepted (and read as the default) although the type is not optional
    omit_none: bool = False  # not written at all when None
    omit_default: bool = False  # not written when it holds the dataclass default (files from before it stay byte-identical)
    flow: bool = False  # lists and nested records written on one line
    digits: int | None = None  # numbers in a list are rounded to this many digits when written
    not_below: str | None = None  # numbers: must not be smaller than this earlier field of the record
    increasing: bool = False  # numbers in a list must be non-decreasing
    nonempty: bool = False  # strings in a list must not be empty
    per_layer: bool = False  # a list with one entry per model layer (model.num_layers)
    may_be_empty: bool = False  # per_layer lists: an empty list is allowed too
    index_key: str | None = None  # lists of records: each entry states its position under this key
    wrap: str | None = None  # the value is stored as the only entry of a mapping under this key
    example: Any = None  # wrap: a sample value for the error message
    keys: tuple[str, str] = ("key", "value")  # tables: what the keys and values are, for errors
    key_low: int | None = None  # tables: lower bound of the (integer) keys


def rule(**constraints: Any) -> dict[str, Rule]:
    """Field metadata: `field(default=None, metadata=rule(low=0, high=1))`."""
    return {RULE_KEY: Rule(**constraints)}


@dataclass(frozen=True)
class Legacy:
    """A key older files may hold that no longer names a field of its record (the record's
    `LEGACY_KEYS` table maps each such key to one of these). Its value is checked as a field of
    `kind` ("str", "int", "float", "bool") with `rule` would be, then dropped; or, with `into`
    ("field.key"), it becomes entry `key` of the record field `field`, which is left out when its
    legacy keys do not give all its required entries or this value is `off` (the old "none").
    A legacy key may share its name with the field it became: it is the legacy one while its value
    is no mapping."""

    kind: str
    rule: Rule = Rule()
    into: str | None = None
    off: Any = None


def legacy(kind: str, *, into: str | None = None, off: Any = None, **constraints: Any) -> Legacy:
    """An entry of a `LEGACY_KEYS` table: `{"draft_rounds": legacy("int", low=1, into="draft.rounds")}`."""
    return Legacy(kind, Rule(**constraints), into, off)


@dataclass(frozen=True)
class DocField:
    """One dataclass field as the document sees it."""

    name: str
    kind: str  # str, int, float, bool, record, records, strings, floats, table
    rule: Rule
    required: bool
    nullable: bool  # null accepted in a file
    optional: bool  # None allowed in the dataclass (`X | None`)
    record: type | None  # the nested dataclass of `record` and `records` fields


@functools.cache
def document_fields(cls: type) -> tuple[DocField, ...]:
    hints = typing.get_type_hints(cls)
    result = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("kvtool.memory-only"):
            continue
        field_rule = f.metadata.get(RULE_KEY, Rule())
        hint, optional = _strip_none(hints[f.name])
        kind, record = _kind(hint, f"{cls.__name__}.{f.name}")
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        result.append(
            DocField(
                name=f.name,
                kind=kind,
                rule=field_rule,
                required=field_rule.required or not has_default,
                nullable=optional or field_rule.nullable,
                optional=optional,
                record=record,
            )
        )
    return tuple(result)


def _strip_none(hint: Any) -> tuple[Any, bool]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False


def _kind(hint: Any, where: str) -> tuple[str, type | None]:
    if hint in (str, int, float, bool):
        return hint.__name__, None
    if dataclasses.is_dataclass(hint):
        return "record", hint
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = args[0]
        if dataclasses.is_dataclass(item):
            return "records", item
        if item is str:
            return "strings", None
        if item is float:
            return "floats", None
    if origin is dict and args == (int, float):
        return "table", None
    raise TypeError(f"{where}: no document form for type {hint!r}")
