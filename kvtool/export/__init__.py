"""Export a profile to a serving engine: what the engine holds of it, as its own command or config.

    exported = export_profile(profile, "vllm", prompt_tokens=4096)
    exported.text   # `vllm serve MODEL ...` and the notes; exported.data the same as a dict

One engine per module (`base.Engine`), one line each in `ENGINES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtool.errors import KvtoolError
from kvtool.export.base import DEFAULT_PROMPT_TOKENS, Engine, Held, hold
from kvtool.export.trtllm import TrtLlm
from kvtool.export.vllm import Vllm
from kvtool.profiles import Profile, profile_to_dict

ENGINES: dict[str, Engine] = {engine.name: engine for engine in (Vllm(), TrtLlm())}


def get_engine(name: str) -> Engine:
    if name not in ENGINES:
        raise KvtoolError(f"unknown engine {name!r} (known: {', '.join(ENGINES)})")
    return ENGINES[name]


@dataclass(frozen=True)
class Exported:
    held: Held
    text: str  # what `kvtool export` prints
    data: dict  # what `kvtool export --json` prints


def export_profile(
    profile: Profile, engine: str, *, model: str | None = None, prompt_tokens: int | None = None, max_seq_len: int | None = None,
) -> Exported:
    """What `engine` holds of `profile`, as its command line or config (`kvtool export`)."""
    exporter = get_engine(engine)
    held = hold(exporter, profile, model=model, prompt_tokens=prompt_tokens)
    options: dict[str, Any] = {"profile": profile, "max_seq_len": max_seq_len}
    data = {
        "engine": held.engine, "model": held.model, **exporter.data(held, **options),
        "windows": list(held.windows), "prompt_tokens": held.prompt_tokens, "kept_entries": round(held.kept_entries, 4),
        "holds": held.holds, "mapping": held.mapping, "stays_behind": held.stays_behind, "behind": list(held.behind),
        "measured": None if held.measured is None else _recipe_dict(profile),
    }
    return Exported(held, exporter.render(held, **options), data)


def _recipe_dict(profile: Profile) -> dict:
    return profile_to_dict(profile)["calibration"]["engine"]


__all__ = ["DEFAULT_PROMPT_TOKENS", "ENGINES", "Engine", "Exported", "Held", "export_profile", "get_engine"]
