"""vLLM 0.33: one `vllm serve MODEL ...` line.

Windows are `--hf-overrides '{"layer_types": [...], "sliding_window": W}'`: the chosen layers become
sliding-window layers of one size W (no sinks; the hybrid KV-cache manager frees blocks outside the
window), so per-layer windows become one, the mean of theirs (the same entries at the prompt length).
The KV dtype is `--kv-cache-dtype`; layers at native precision beside it are
`--kv-cache-dtype-skip-layers`. kvtool's int8 and fp8 keep one scale per token and head, as vLLM's
`int8_per_token_head` and `fp8_per_token_head` do (vLLM's `fp8` / `fp8_e4m3` keep one per tensor).
"""

from __future__ import annotations

import json
import math
import shlex
from typing import Any

from kvtool.errors import KvtoolError
from kvtool.export.base import Engine, Held
from kvtool.profiles import Profile

# Model types whose vLLM class does not read `layer_types` (Qwen3's, a known vLLM limitation), so
# the override would serve the full cache while claiming windows.
IGNORES_LAYER_TYPES = ("qwen3", "qwen3_moe")

_NOTES = {
    "int4": "kvtool's int4 (asymmetric, one scale per token and head) is int4_per_token_head less vLLM's rotation",
    "int4-g32": "int4-g32's groups of 32 become one scale per token and head (int4_per_token_head)",
    "int2-g32": "vLLM has no 2-bit KV: int2-g32 layers stored at int4_per_token_head (twice the bytes)",
}


class Vllm(Engine):
    name = "vllm"

    def nearest(self, fmt: str) -> tuple[str, str | None]:
        if fmt in ("native", "int8", "fp8"):
            return fmt, None
        return "int4", _NOTES.get(fmt)

    def unify(self, windows: list[int | None], tokens: int) -> tuple[list[int | None], str | None]:
        sizes = [w for w in windows if w is not None]
        if len(set(sizes)) <= 1:
            return windows, None
        one = math.ceil(sum(sizes) / len(sizes))
        note = (f"per-layer windows ({min(sizes)}-{max(sizes)} tokens) become one of {one} "
                "(vLLM takes one sliding_window; their mean: the same entries in all)")
        return [None if w is None else one for w in windows], note

    def check(self, profile: Profile, windows: tuple[int | None, ...]) -> None:
        if _overrides(profile, windows) is not None and profile.model.model_type in IGNORES_LAYER_TYPES:
            raise KvtoolError(
                f"vLLM cannot serve this profile's windows: its {profile.model.model_type} model ignores "
                "--hf-overrides layer_types; try --engine trtllm"
            )

    def argv(self, held: Held, profile: Profile) -> list[str]:
        argv = ["vllm", "serve", held.model]
        if held.kv_cache_dtype != "auto":
            argv += ["--kv-cache-dtype", held.kv_cache_dtype]
        if held.skip_layers and held.kv_cache_dtype != "auto":
            argv += ["--kv-cache-dtype-skip-layers", *map(str, held.skip_layers)]
        overrides = _overrides(profile, held.windows)
        if overrides is not None:
            argv += ["--hf-overrides", json.dumps(overrides, separators=(",", ":"))]
        return argv

    def render(self, held: Held, *, profile: Profile, **options: Any) -> str:
        return "\n".join([
            shlex.join(self.argv(held, profile)),
            f"# holds: {held.holds}",
            f"# mapping: {held.mapping}",
            f"# stays behind: {held.stays_behind}",
        ])

    def data(self, held: Held, *, profile: Profile, **options: Any) -> dict:
        argv = self.argv(held, profile)
        return {
            "argv": argv, "command": shlex.join(argv),
            "hf_overrides": _overrides(profile, held.windows),
            "kv_cache_dtype": held.kv_cache_dtype,
            "kv_cache_dtype_skip_layers": [str(i) for i in held.skip_layers] if held.kv_cache_dtype != "auto" else [],
        }


def _overrides(profile: Profile, windows: tuple[int | None, ...]) -> dict | None:
    """The `--hf-overrides` value, or None when every layer keeps the model's own attention."""
    kinds = profile.model.layer_types or ("full_attention",) * len(windows)
    own = profile.model.sliding_window
    changed = any(
        (w is not None) != (kind == "sliding_attention") or (w is not None and w != own)
        for w, kind in zip(windows, kinds)
    )
    if not changed:
        return None
    sizes = {w for w in windows if w is not None}
    return {
        "layer_types": ["full_attention" if w is None else "sliding_attention" for w in windows],
        "sliding_window": sizes.pop(),
    }
