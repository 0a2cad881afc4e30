"""Apply a profile as a per-layer merging/eviction KV cache inside transformers generation.

    profile = load_profile("profile.yaml")          # or uniform_profile(model, budget=0.2)
    handle = attach(model, profile)
    out = handle.generate(**inputs, max_new_tokens=256)  # model.generate with the profile's cache and draft
    handle.detach()

`model.generate(**inputs, cache=handle.new_cache())` (`past_key_values=` before transformers 5.24)
works too for a profile without a draft; for one with a draft `new_cache()` refuses, since a bare
cache would skip it. `use_settings(...)` (runtime.settings) switches how the runtime computes on a
GPU for the code inside it (`RuntimeSettings`: where a draft holds its prompts, the fused decode step).
"""

from kvtool.runtime.attach import KvtoolHandle, attach, load_profile, uniform_profile
from kvtool.runtime.cache import KvtoolCache
from kvtool.runtime.methods import METHODS, method_profile
from kvtool.runtime.settings import RuntimeSettings, current_settings, use_settings

__all__ = [
    "METHODS", "KvtoolCache", "KvtoolHandle", "RuntimeSettings", "attach", "current_settings", "load_profile",
    "method_profile", "uniform_profile", "use_settings",
]
