"""Profile files: read (strictly validated) and save (atomically), with an exact YAML round trip.

The document layout and its checks come from the schema's field declarations
(`kvtool.profiles.document`, `kvtool.profiles.validate`); this module adds the file around them.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import IO, Any

import yaml

from kvtool.errors import KvtoolError
from kvtool.files import write_atomic
from kvtool.profiles.document import FlowDict, FlowList, profile_from_document, profile_to_dict
from kvtool.profiles.queries import load_query_stats, save_query_stats, sidecar_path
from kvtool.profiles.schema import SCHEMA_VERSION, Profile, QueriesFile
from kvtool.profiles.validate import check_document, validate_profile

HEADER = f"# kvtool profile v{SCHEMA_VERSION} — budget is the share of the full KV cache's bytes KEPT\n"


def save_profile(profile: Profile, path: str | os.PathLike[str]) -> Path:
    """Validate `profile` and write it atomically to `path` (parent dirs are created), its query
    statistics first, to the sidecar the YAML then names."""
    dest = Path(path)
    validate_profile(profile, source=str(dest))
    stats = profile.query_stats
    if stats is not None:
        sidecar = sidecar_path(dest)
        model = profile.model
        digest = save_query_stats(stats, sidecar, heads=model.num_attention_heads, head_dim=model.head_dim)
        profile = dataclasses.replace(profile, queries=QueriesFile(sidecar.name, digest, stats.future))
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

    return write_atomic(dest, write, what="profile")


def read_profile(path: str | os.PathLike[str]) -> Profile:
    """Read and validate a profile file; any problem is a one-line KvtoolError."""
    source = Path(path)
    document = _load_yaml(source)
    profile = profile_from_document(check_document(document, str(source)))
    ref = profile.queries
    if ref is None:
        return profile
    if Path(ref.file).name != ref.file:
        raise KvtoolError(f"{source}: queries.file must name a file beside the profile, got {ref.file!r}")
    model = profile.model
    stats = load_query_stats(
        source.with_name(ref.file), ref.sha256, heads=model.num_attention_heads, head_dim=model.head_dim,
        future=ref.future_positions,
    )
    return dataclasses.replace(profile, query_stats=stats)


class _ProfileDumper(yaml.SafeDumper):
    pass


def _represent_flow_list(dumper: yaml.SafeDumper, data: FlowList) -> yaml.Node:
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)


def _represent_flow_dict(dumper: yaml.SafeDumper, data: FlowDict) -> yaml.Node:
    return dumper.represent_mapping("tag:yaml.org,2002:map", data, flow_style=True)


_ProfileDumper.add_representer(FlowList, _represent_flow_list)
_ProfileDumper.add_representer(FlowDict, _represent_flow_dict)


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
