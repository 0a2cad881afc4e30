"""Strict validation of a profile document, driven by the fields' declarations in the schema.

Every problem is a one-line KvtoolError naming the file and the field (dotted path such as
`model.num_kv_heads` or `layers[3].ratio`). Validation runs on the plain-data document, so the same
checks cover files read from disk and profiles built in code (`validate_profile` converts the
dataclasses to a document first).
"""

from __future__ import annotations

import copy
import difflib
import math
from collections.abc import Iterable
from typing import Any

from kvtool.errors import KvtoolError
from kvtool.profiles.document import profile_to_dict
from kvtool.profiles.fields import DocField, Legacy, Rule, document_fields
from kvtool.profiles.schema import SCHEMA_VERSION, Profile

SUPPORTED_SCHEMA_VERSIONS = (SCHEMA_VERSION,)


def validate_profile(profile: Profile, source: str = "profile") -> None:
    """Raise KvtoolError (one line, prefixed with `source`) if `profile` is not a valid v1 profile."""
    try:
        document = profile_to_dict(profile)
    except (AttributeError, TypeError) as exc:
        raise KvtoolError(f"{source}: not a kvtool profile ({exc})") from exc
    check_document(document, source)


def check_document(doc: Any, source: str) -> dict[str, Any]:
    """Raise KvtoolError unless `doc` (parsed YAML) is a valid profile document; return it in
    the current form (a copy, each record's legacy keys replaced by what they became)."""
    root = _Node(doc, "", source)
    if not isinstance(doc, dict):
        raise root.fail(f"expected a YAML mapping at the top level, got {_describe(doc)}")
    # Version first: a newer file should say "unsupported version", not "unknown field".
    _check_schema_version(root)
    doc = copy.deepcopy(doc)
    _check_record(_Node(doc, "", source), Profile, doc)
    _check_native_bytes(root, doc)
    return doc


def _check_native_bytes(root: _Node, doc: dict) -> None:
    """A layer stored in another format than the model's is counted against the model's own bytes
    per value, so the profile must say them (`native_bytes`)."""
    stored = [
        i for i, layer in enumerate(doc.get("layers") or ())
        if isinstance(layer, dict) and (layer.get("keys_format", "native"), layer.get("values_format", "native")) != ("native", "native")
    ]
    if stored and doc.get("native_bytes") is None:
        raise root.fail(f"layer {stored[0]} stores quantized entries, so native_bytes (bytes per value at the model's own precision) is required")


def _check_schema_version(root: _Node) -> None:
    if "schema_version" not in root.value:
        raise root.fail("missing field schema_version")
    version = root.child("schema_version").integer()
    if version not in SUPPORTED_SCHEMA_VERSIONS:
        supported = ", ".join(str(v) for v in SUPPORTED_SCHEMA_VERSIONS)
        raise root.fail(f"schema_version {version} is not supported (this kvtool reads version {supported})")


def _check_record(node: _Node, cls: type, doc: dict, index: tuple[str, int] | None = None) -> None:
    """A mapping holding the fields of dataclass `cls`, and with `index` its position in a list."""
    fields = document_fields(cls)
    legacy: dict[str, Legacy] = getattr(cls, "LEGACY_KEYS", {})
    index_key = () if index is None else (index[0],)
    required = (*index_key, *(f.name for f in fields if f.required))
    optional = (*(f.name for f in fields if not f.required), *legacy)
    node.mapping(required, optional)
    if legacy:
        _upgrade_legacy(node, fields, legacy, doc)
    if index is not None:
        key, expected = index
        position = node.child(key).integer()
        if position != expected:
            # Entries are stored in order; a mismatch means some were dropped or shuffled by hand.
            listed = node.path.rpartition("[")[0]
            raise node.fail(f"{node.path}.{key} is {position}, expected {expected} ({listed} must be listed in order)")
    for f in fields:
        if f.name in node.value:
            _check_field(node.child(f.name), f, doc, node)


def _upgrade_legacy(node: _Node, fields: tuple[DocField, ...], legacy: dict[str, Legacy], doc: dict) -> None:
    """Check the legacy keys of record `node` (its class's `LEGACY_KEYS`) and replace them, in
    place, by what they became: nothing, or entries of a record field (`Legacy.into`)."""
    by_name = {f.name: f for f in fields}
    moved: dict[str, dict[str, Any]] = {}
    off: set[str] = set()
    for key, old in legacy.items():
        if key not in node.value or (key in by_name and isinstance(node.value[key], dict)):
            continue  # absent, or the field of that name in the current form
        at = node.child(key)
        del node.value[key]
        if at.value is None:
            continue
        if old.rule.choices and at.value not in old.rule.choices:
            raise at.fail(f"{at.path} must be one of {', '.join(old.rule.choices)}, got {at.value!r}")
        _check_field(at, DocField(key, old.kind, old.rule, False, True, True, None), doc, node)
        if old.into is None:
            continue
        target, _, entry = old.into.partition(".")
        if target in node.value:
            raise at.fail(f"{at.path} is the old form of {node._sub(target)}, which is given too")
        moved.setdefault(target, {})[entry] = at.value
        if old.off is not None and at.value == old.off:
            off.add(target)
    for target, entries in moved.items():
        needed = [f.name for f in document_fields(by_name[target].record) if f.required]
        if target not in off and all(name in entries for name in needed):
            node.value[target] = entries


def _check_field(node: _Node, f: DocField, doc: dict, record: _Node) -> None:
    rule = f.rule
    if node.value is None and f.nullable:
        return
    if rule.wrap is not None:
        if not isinstance(node.value, dict):
            raise node.fail(
                f"{node.path} must be a mapping like {{{rule.wrap}: {rule.example}}}, got {_describe(node.value)}"
            )
        node = node.mapping((rule.wrap,)).child(rule.wrap)
    if f.kind == "str":
        name = node.string()
        if rule.choices and name not in rule.choices:
            raise node.fail(f"{node.path} must be one of {', '.join(rule.choices)}, got {name!r}")
    elif f.kind in ("int", "float"):
        value = node.integer(rule.low) if f.kind == "int" else node.number(rule.low, rule.high, open_low=rule.open_low)
        other = rule.not_below
        if other is not None and value < record.value[other]:
            raise record.fail(
                f"{record.path}.{other} ({record.value[other]}) is larger than {node.path} ({value})"
            )
    elif f.kind == "bool":
        node.boolean()
    elif f.kind == "record":
        _check_record(node, f.record, doc)
    elif f.kind == "records":
        entries = node.sequence()
        _check_per_layer(node, rule, doc)
        for i in range(len(entries)):
            _check_record(node.item(i), f.record, doc, (rule.index_key, i) if rule.index_key else None)
    elif f.kind == "strings":
        for i in range(len(node.sequence())):
            if not node.item(i).string() and rule.nonempty:
                raise node.fail(f"{node.path}[{i}] must not be empty")
        _check_per_layer(node, rule, doc)
    elif f.kind == "floats":
        previous = 0.0
        for i in range(len(node.sequence())):
            point = node.item(i).number(rule.low, rule.high, open_low=rule.open_low)
            if rule.increasing and point < previous:
                raise node.fail(f"{node.path} must be non-decreasing, but [{i}] = {point} < {previous}")
            previous = point
    elif f.kind == "table":
        _check_table(node, rule)


def _check_per_layer(node: _Node, rule: Rule, doc: dict) -> None:
    """A list the rule says has one entry per model layer has that many."""
    if not rule.per_layer or (rule.may_be_empty and not node.value):
        return
    num_layers = doc["model"]["num_layers"]  # checked already: the model comes first
    if len(node.value) != num_layers:
        raise node.fail(f"{node.path} has {len(node.value)} entries but model.num_layers is {num_layers}")


def _check_table(table: _Node, rule: Rule) -> None:
    key_name, value_name = rule.keys
    if not isinstance(table.value, dict):
        raise table.fail(f"{table.path} must be a mapping of {key_name} -> {value_name}, got {_describe(table.value)}")
    for key, value in table.value.items():
        if isinstance(key, bool) or not isinstance(key, int):
            raise table.fail(f"{table.path} keys must be integer {key_name}s, got {_describe(key)}")
        if rule.key_low is not None and key < rule.key_low:
            raise table.fail(f"{table.path} {key_name} must be >= {rule.key_low}, got {key}")
        _Node(value, f"{table.path}[{key!r}]", table.source).number(rule.low, rule.high, open_low=rule.open_low)


class _Node:
    """One value of the document plus where it sits, so every error can name its field."""

    def __init__(self, value: Any, path: str, source: str) -> None:
        self.value = value
        self.path = path
        self.source = source

    def fail(self, problem: str) -> KvtoolError:
        return KvtoolError(f"{self.source}: {problem}")

    def child(self, key: str) -> _Node:
        path = f"{self.path}.{key}" if self.path else key
        return _Node(self.value[key], path, self.source)

    def item(self, index: int) -> _Node:
        return _Node(self.value[index], f"{self.path}[{index}]", self.source)

    def mapping(self, required: Iterable[str], optional: Iterable[str] = ()) -> _Node:
        """Require a mapping with all `required` keys and nothing but the known keys."""
        required, optional = tuple(required), tuple(optional)
        if not isinstance(self.value, dict):
            raise self.fail(f"{self.path} must be a mapping, got {_describe(self.value)}")
        for key in required:
            if key not in self.value:
                raise self.fail(f"missing field {self._sub(key)}")
        known = required + optional
        for key in self.value:
            if key not in known:
                raise self.fail(f"unknown field {self._sub(str(key))}{_suggest(key, known)}")
        return self

    def integer(self, minimum: int | None = None) -> int:
        value = self.value
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(f"{self.path} must be an integer, got {_describe(value)}")
        if minimum is not None and value < minimum:
            raise self.fail(f"{self.path} must be >= {minimum}, got {value}")
        return value

    def number(self, low: float | None = None, high: float | None = None, *, open_low: bool = False) -> float:
        """A finite int/float within [low, high] (or (low, high] with `open_low`)."""
        value = self.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(f"{self.path} must be a number, got {_describe(value)}")
        if not math.isfinite(value):
            raise self.fail(f"{self.path} must be a finite number, got {value}")
        too_low = low is not None and (value <= low if open_low else value < low)
        too_high = high is not None and value > high
        if too_low or too_high:
            raise self.fail(f"{self.path} must be {_range_text(low, high, open_low)}, got {value}")
        return float(value)

    def string(self) -> str:
        if not isinstance(self.value, str):
            raise self.fail(f"{self.path} must be a string, got {_describe(self.value)}")
        return self.value

    def boolean(self) -> bool:
        if not isinstance(self.value, bool):
            raise self.fail(f"{self.path} must be true or false, got {_describe(self.value)}")
        return self.value

    def sequence(self) -> list[Any]:
        if not isinstance(self.value, list):
            raise self.fail(f"{self.path} must be a list, got {_describe(self.value)}")
        return self.value

    def _sub(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key


def _describe(value: Any) -> str:
    """`str 'abc'`, `list`, `null`: short, one line, whatever the value holds."""
    if value is None:
        return "null"
    kind = type(value).__name__
    if isinstance(value, (dict, list, tuple)):
        return kind
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{kind} {text}"


def _range_text(low: float | None, high: float | None, open_low: bool) -> str:
    """`in (0, 1]`, `in [0, 1]`, `> 0` or `>= 0`."""
    lo = "-inf" if low is None else f"{low:g}"
    if high is None:
        return f"{'>' if open_low else '>='} {lo}"
    left = "(" if open_low else "["
    return f"in {left}{lo}, {high:g}]"


def _suggest(key: Any, known: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(key), known, n=1)
    return f" (did you mean {close[0]}?)" if close else f" (known: {', '.join(known)})"
