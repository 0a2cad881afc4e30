"""Apply a profile as a per-layer merging/eviction KV cache inside transformers generation.

    profile = load_profile("profile.yaml")          # or uniform_profile(model, budget=0.2)
    handle = attach(model, profile)
    out = model.generate(**inputs, cache=handle.new_cache(), max_new_tokens=256)  # < 5.24: past_key_values=
    handle.detach()
"""

from kvtool.runtime.attach import KvtoolHandle, attach, load_profile, uniform_profile
from kvtool.runtime.cache import KvtoolCache
from kvtool.runtime.methods import METHODS, method_profile

__all__ = ["METHODS", "KvtoolCache", "KvtoolHandle", "attach", "load_profile", "method_profile", "uniform_profile"]
