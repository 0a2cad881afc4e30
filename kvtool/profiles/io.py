"""Profile <-> YAML: exact round trip, strict validation, atomic writes.

Every problem with a profile is reported as a one-line KvtoolError naming the file and the
field (dotted path such as `model.num_kv_heads` or `layers[3].ratio`). Validation runs on the
plain-data document, so the same checks cover files read from disk and profiles built in code
(`validate_profile` converts the dataclasses to a document first).
"""

from __future__ import annotations

import contextlib
import difflib
import math
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, Any

import yaml

from kvtool.errors import KvtoolError
from kvtool.profiles.schema import (
    EVICTION_RULES,
    MERGE_MODES,
    SELECTION_RULES,
    SCHEMA_VERSION,
    CURVE_IMPORTANCE,
    CalibrationInfo,
    LayerProfile,
    MethodSettings,
    ModelFingerprint,
    Profile,
    PromptStats,
)

SUPPORTED_SCHEMA_VERSIONS = (SCHEMA_VERSION,)

HEADER = f"# kvtool profile v{SCHEMA_VERSION} — budget is the fraction of KV entries KEPT\n"

# Curves are for display (Lorenz plots), so 6 digits are plenty and keep the file readable.
CURVE_DIGITS = 6

# Profiles created by kvtool get ordinary file permissions, not tempfile's private 0600.
_NEW_FILE_MODE = 0o644


# --------------------------------------------------------------------------- public API


def save_profile(profile: Profile, path: str | os.PathLike[str]) -> Path:
    """Validate `profile` and write it atomically to `path` (parent dirs are created)."""
    dest = Path(path)
    validate_profile(profile, source=str(dest))
    document = profile_to_dict(profile)

    def write(stream: IO[str]) -> None:
        stream.write(HEADER)
        yaml.dump(
            document,
            stream,
            Dumper=_ProfileDumper,
            sort_keys=False,
            allow_unicode=True,
            default_flow_style=False,
            width=100,
        )

    _write_atomic(dest, write)
    return dest


def read_profile(path: str | os.PathLike[str]) -> Profile:
    """Read and validate a profile file; any problem is a one-line KvtoolError."""
    source = Path(path)
    document = _load_yaml(source)
    _check_document(document, str(source))
    return _profile_from_document(document)


def validate_profile(profile: Profile, source: str = "profile") -> None:
    """Raise KvtoolError (one line, prefixed with `source`) if `profile` is not a valid v1 profile."""
    try:
        document = profile_to_dict(profile)
    except (AttributeError, TypeError) as exc:
        raise KvtoolError(f"{source}: not a kvtool profile ({exc})") from exc
    _check_document(document, source)


def profile_to_dict(profile: Profile) -> dict[str, Any]:
    """The profile as the plain document stored in YAML (and printed by `inspect --json`)."""
    return {
        "schema_version": profile.schema_version,
        "kvtool_version": profile.kvtool_version,
        "created": profile.created,
        "budget": {"kept_fraction": profile.budget},
        "model": _model_to_dict(profile.model),
        "method": {
            "merge": profile.method.merge,
            "sink_tokens": profile.method.sink_tokens,
            "recent_window": profile.method.recent_window,
            "truncation_distance": profile.method.truncation_distance,
            "selection": profile.method.selection,
            "eviction": profile.method.eviction,
        },
        "calibration": _calibration_to_dict(profile.calibration),
        "layers": [_layer_to_dict(i, layer) for i, layer in enumerate(profile.layers)],
    }


# --------------------------------------------------------------------------- dataclasses -> document


class _FlowList(list):  # type: ignore[type-arg]
    """A list written on one line (`[0.1, 0.2]`): long columns of floats are unreadable."""


class _ProfileDumper(yaml.SafeDumper):
    pass


def _represent_flow_list(dumper: yaml.SafeDumper, data: _FlowList) -> yaml.Node:
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)


_ProfileDumper.add_representer(_FlowList, _represent_flow_list)


def _model_to_dict(model: ModelFingerprint) -> dict[str, Any]:
    return {
        "name": model.name,
        "model_type": model.model_type,
        "num_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "hidden_size": model.hidden_size,
        "vocab_size": model.vocab_size,
        "layer_types": _FlowList(model.layer_types),
    }


def _calibration_to_dict(info: CalibrationInfo | None) -> dict[str, Any] | None:
    if info is None:
        return None
    return {
        "dataset_hash": info.dataset_hash,
        "samples": info.samples,
        "prompt_tokens": {
            "min": info.prompt_tokens.min,
            "mean": info.prompt_tokens.mean,
            "max": info.prompt_tokens.max,
        },
        "retention_p": info.retention_p,
        "truncation_ppl": dict(info.truncation_ppl),
        "ppl_full": info.ppl_full,
        "ppl_compressed": info.ppl_compressed,
        "seed": info.seed,
        "seconds": info.seconds,
        "curve_importance": info.curve_importance,
    }


def _layer_to_dict(index: int, layer: LayerProfile) -> dict[str, Any]:
    document = {
        "layer": index,
        "ratio": layer.ratio,
        "compress": layer.compress,
        "gini": layer.gini,
        "ratio_std": layer.ratio_std,
        "priority_curve": _FlowList(_round_curve_value(v) for v in layer.priority_curve),
    }
    if layer.image_share is not None:  # only calibrations with images have it; text profiles stay as they were
        document["image_share"] = layer.image_share
    return document


def _round_curve_value(value: Any) -> Any:
    # Non-floats are left as they are so validation can name them instead of crashing here.
    if isinstance(value, float) and math.isfinite(value):
        return round(value, CURVE_DIGITS)
    return value


# --------------------------------------------------------------------------- document -> dataclasses
# These trust the document: `_check_document` has already run.


def _profile_from_document(doc: Mapping[str, Any]) -> Profile:
    method = doc["method"]
    return Profile(
        budget=float(doc["budget"]["kept_fraction"]),
        model=_model_from_dict(doc["model"]),
        method=MethodSettings(
            **{k: method[k] for k in _METHOD_KEYS if k in method},
        ),
        layers=tuple(_layer_from_dict(layer) for layer in doc["layers"]),
        calibration=_calibration_from_dict(doc.get("calibration")),
        kvtool_version=doc.get("kvtool_version", ""),
        created=doc.get("created", ""),
        schema_version=doc["schema_version"],
    )


def _model_from_dict(m: Mapping[str, Any]) -> ModelFingerprint:
    return ModelFingerprint(
        name=m["name"],
        model_type=m["model_type"],
        num_layers=m["num_layers"],
        num_attention_heads=m["num_attention_heads"],
        num_kv_heads=m["num_kv_heads"],
        head_dim=m["head_dim"],
        hidden_size=m["hidden_size"],
        vocab_size=m["vocab_size"],
        layer_types=tuple(m.get("layer_types") or ()),
    )


def _calibration_from_dict(c: Mapping[str, Any] | None) -> CalibrationInfo | None:
    if c is None:
        return None
    tokens = c["prompt_tokens"]
    return CalibrationInfo(
        dataset_hash=c["dataset_hash"],
        samples=c["samples"],
        prompt_tokens=PromptStats(min=tokens["min"], mean=float(tokens["mean"]), max=tokens["max"]),
        retention_p=_opt_float(c.get("retention_p")),
        truncation_ppl={int(d): float(ppl) for d, ppl in (c.get("truncation_ppl") or {}).items()},
        ppl_full=_opt_float(c.get("ppl_full")),
        ppl_compressed=_opt_float(c.get("ppl_compressed")),
        seed=c.get("seed"),
        seconds=_opt_float(c.get("seconds")),
        curve_importance=c.get("curve_importance"),
    )


def _layer_from_dict(layer: Mapping[str, Any]) -> LayerProfile:
    return LayerProfile(
        ratio=float(layer["ratio"]),
        compress=layer.get("compress", True),
        gini=_opt_float(layer.get("gini")),
        ratio_std=_opt_float(layer.get("ratio_std")),
        priority_curve=tuple(float(v) for v in layer.get("priority_curve") or ()),
        image_share=_opt_float(layer.get("image_share")),
    )


def _opt_float(value: Any) -> float | None:
    # YAML reads `1` as int; the dataclasses hold floats.
    return None if value is None else float(value)


# --------------------------------------------------------------------------- validation

_TOP_REQUIRED = ("schema_version", "budget", "model", "method", "layers")
_TOP_OPTIONAL = ("kvtool_version", "created", "calibration")
_MODEL_INTS = ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "hidden_size", "vocab_size")
_METHOD_KEYS = ("merge", "sink_tokens", "recent_window", "truncation_distance", "selection", "eviction")
_METHOD_NAMES = {"merge": MERGE_MODES, "selection": SELECTION_RULES, "eviction": EVICTION_RULES}
_METHOD_COUNTS = ("sink_tokens", "recent_window", "truncation_distance")
_CALIBRATION_REQUIRED = ("dataset_hash", "samples", "prompt_tokens")
_CALIBRATION_OPTIONAL = (
    "retention_p", "truncation_ppl", "ppl_full", "ppl_compressed", "seed", "seconds", "curve_importance",
)
_LAYER_OPTIONAL = ("compress", "gini", "ratio_std", "priority_curve", "image_share")


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

    def optional_number(
        self, low: float | None = None, high: float | None = None, *, open_low: bool = False
    ) -> float | None:
        return None if self.value is None else self.number(low, high, open_low=open_low)

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


def _check_document(doc: Any, source: str) -> None:
    root = _Node(doc, "", source)
    if not isinstance(doc, dict):
        raise root.fail(f"expected a YAML mapping at the top level, got {_describe(doc)}")
    # Version first: a newer file should say "unsupported version", not "unknown field".
    _check_schema_version(root)
    root.mapping(_TOP_REQUIRED, _TOP_OPTIONAL)
    for key in ("kvtool_version", "created"):
        if key in doc:
            root.child(key).string()
    budget = root.child("budget")
    if not isinstance(budget.value, dict):
        # A bare number is ambiguous (kept or evicted?), which is what the mapping is for.
        raise budget.fail(
            f"budget must be a mapping like {{kept_fraction: 0.2}}, got {_describe(budget.value)}"
        )
    budget.mapping(("kept_fraction",)).child("kept_fraction").number(0.0, 1.0, open_low=True)
    num_layers = _check_model(root.child("model"))
    _check_method(root.child("method"))
    if doc.get("calibration") is not None:
        _check_calibration(root.child("calibration"))
    _check_layers(root.child("layers"), num_layers)


def _check_schema_version(root: _Node) -> None:
    if "schema_version" not in root.value:
        raise root.fail("missing field schema_version")
    version = root.child("schema_version")
    if isinstance(version.value, bool) or not isinstance(version.value, int):
        raise root.fail(f"schema_version must be an integer, got {_describe(version.value)}")
    if version.value not in SUPPORTED_SCHEMA_VERSIONS:
        supported = ", ".join(str(v) for v in SUPPORTED_SCHEMA_VERSIONS)
        raise root.fail(
            f"schema_version {version.value} is not supported (this kvtool reads version {supported})"
        )


def _check_model(model: _Node) -> int:
    model.mapping(("name", "model_type", *_MODEL_INTS), ("layer_types",))
    model.child("name").string()
    model.child("model_type").string()
    for key in _MODEL_INTS:
        model.child(key).integer(minimum=1)
    num_layers = model.value["num_layers"]
    if "layer_types" in model.value:
        types = model.child("layer_types")
        entries = types.sequence()
        for i in range(len(entries)):
            if not types.item(i).string():
                raise model.fail(f"{types.path}[{i}] must not be empty")
        if entries and len(entries) != num_layers:
            raise model.fail(
                f"{types.path} has {len(entries)} entries but model.num_layers is {num_layers}"
            )
    return num_layers


def _check_method(method: _Node) -> None:
    method.mapping((), _METHOD_KEYS)
    for key, known in _METHOD_NAMES.items():
        if key in method.value:
            name = method.child(key).string()
            if name not in known:
                raise method.fail(f"method.{key} must be one of {', '.join(known)}, got {name!r}")
    for key in _METHOD_COUNTS:
        if key in method.value:
            method.child(key).integer(minimum=0)


def _check_calibration(calibration: _Node) -> None:
    calibration.mapping(_CALIBRATION_REQUIRED, _CALIBRATION_OPTIONAL)
    calibration.child("dataset_hash").string()
    calibration.child("samples").integer(minimum=1)
    tokens = calibration.child("prompt_tokens").mapping(("min", "mean", "max"))
    low = tokens.child("min").integer(minimum=0)
    tokens.child("mean").number(0.0)
    high = tokens.child("max").integer(minimum=0)
    if low > high:
        raise tokens.fail(f"{tokens.path}.min ({low}) is larger than {tokens.path}.max ({high})")
    value = calibration.value
    if "retention_p" in value:
        calibration.child("retention_p").optional_number(0.0, 1.0, open_low=True)
    for key in ("ppl_full", "ppl_compressed"):
        if key in value:
            calibration.child(key).optional_number(0.0, open_low=True)
    if "seconds" in value:
        calibration.child("seconds").optional_number(0.0)
    if value.get("seed") is not None:
        calibration.child("seed").integer()
    if value.get("truncation_ppl") is not None:
        _check_truncation_ppl(calibration.child("truncation_ppl"))
    if value.get("curve_importance") is not None and value["curve_importance"] not in CURVE_IMPORTANCE:
        raise calibration.child("curve_importance").fail(
            f"{calibration.path}.curve_importance must be one of {', '.join(CURVE_IMPORTANCE)}, "
            f"got {value['curve_importance']!r}"
        )


def _check_truncation_ppl(table: _Node) -> None:
    if not isinstance(table.value, dict):
        raise table.fail(
            f"{table.path} must be a mapping of distance -> perplexity, got {_describe(table.value)}"
        )
    for distance, ppl in table.value.items():
        where = f"{table.path}[{distance!r}]"
        if isinstance(distance, bool) or not isinstance(distance, int):
            raise table.fail(f"{table.path} keys must be integer distances, got {_describe(distance)}")
        if distance < 0:
            raise table.fail(f"{table.path} distance must be >= 0, got {distance}")
        _Node(ppl, where, table.source).number(0.0, open_low=True)


def _check_layers(layers: _Node, num_layers: int) -> None:
    entries = layers.sequence()
    if len(entries) != num_layers:
        raise layers.fail(f"layers has {len(entries)} entries but model.num_layers is {num_layers}")
    for index in range(len(entries)):
        _check_layer(layers.item(index), index)


def _check_layer(layer: _Node, index: int) -> None:
    layer.mapping(("layer", "ratio"), _LAYER_OPTIONAL)
    position = layer.child("layer").integer()
    if position != index:
        # Layers are stored in order; a mismatch means entries were dropped or shuffled by hand.
        raise layer.fail(
            f"{layer.path}.layer is {position}, expected {index} (layers must be listed in order)"
        )
    layer.child("ratio").number(0.0, 1.0, open_low=True)
    value = layer.value
    if "compress" in value:
        layer.child("compress").boolean()
    if "gini" in value:
        layer.child("gini").optional_number(0.0, 1.0)
    if "ratio_std" in value:
        layer.child("ratio_std").optional_number(0.0)
    if "image_share" in value:
        layer.child("image_share").optional_number(0.0, 1.0)
    if value.get("priority_curve") is not None:
        _check_curve(layer.child("priority_curve"))


def _check_curve(curve: _Node) -> None:
    points = curve.sequence()
    previous = 0.0
    for i in range(len(points)):
        point = curve.item(i).number(0.0, 1.0)
        if point < previous:
            raise curve.fail(f"{curve.path} must be non-decreasing, but [{i}] = {point} < {previous}")
        previous = point


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


# --------------------------------------------------------------------------- file access


def _load_yaml(path: Path) -> Any:
    if not path.exists():
        raise KvtoolError(f"{path}: no such profile file")
    if path.is_dir():
        raise KvtoolError(f"{path}: is a directory, not a profile file")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise KvtoolError(f"{path}: cannot read profile ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        raise KvtoolError(f"{path}: cannot read profile (not UTF-8 text)") from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise KvtoolError(f"{path}: not valid YAML ({_yaml_problem(exc)})") from exc


def _yaml_problem(exc: yaml.YAMLError) -> str:
    problem = getattr(exc, "problem", None) or "parse error"
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return " ".join(f"{where}{problem}".split())


def _write_atomic(dest: Path, write: Callable[[IO[str]], None]) -> None:
    """Write via a temp file in the same directory so readers never see half a profile."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.NamedTemporaryFile(
            "w", encoding="utf-8", dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp", delete=False
        )
    except OSError as exc:
        raise _write_error(dest, exc) from exc
    try:
        with tmp:
            write(tmp)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.chmod(tmp.name, _mode_for(dest))
        os.replace(tmp.name, dest)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp.name)
        if isinstance(exc, OSError):
            raise _write_error(dest, exc) from exc
        raise
    _fsync_dir(dest.parent)


def _mode_for(dest: Path) -> int:
    # Overwriting keeps the existing file's permissions.
    try:
        return stat.S_IMODE(dest.stat().st_mode)
    except OSError:
        return _NEW_FILE_MODE


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not possible on every platform, and not worth failing over.
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_error(dest: Path, exc: OSError) -> KvtoolError:
    return KvtoolError(f"cannot write profile to {dest}: {exc.strerror or exc}")
