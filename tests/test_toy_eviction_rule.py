"""Adding an eviction rule is one new file (here a class standing for it) and one registry line.

The toy rule below is registered the way a new rule is (`EVICT_RULES[name] = Rule`, here through a
fixture that removes it again) and nothing else is told about it: a profile names it, is saved and
loaded, and the cache applies it through the attention function. Checked by brute force: the set of
logical columns each row of each layer holds is followed by hand from the compressed prompt on (add
the new token; when the row holds more than ceil(R * T) entries, drop what the toy rule names), and
the cache holds exactly that set after every step.
"""

from __future__ import annotations

import pytest
import torch

from kvtool.models.forward import with_cache
from kvtool.profiles import save_profile
from kvtool.runtime import attach, load_profile
from kvtool.runtime.eviction import EVICT_RULES, EntryView, EvictRule
from kvtool.runtime.selection import kept_count
from tiny_models import left_pad, profile_with, prompts, tiny_llama

RATIOS = [0.3, 0.5, 0.2]


class NewestFirst(EvictRule):
    """`newest-first`, a toy: the cache is a stack. The newest entry older than the token just
    placed goes, so the compressed prompt stays and only the latest token follows it."""

    name = "newest-first"

    def victim(self, entries: EntryView) -> torch.Tensor:
        older = entries.valid & (entries.order < entries.seen - 1)
        return torch.where(older, entries.order, -1).argmax(dim=-1)


@pytest.fixture
def newest_first(monkeypatch):
    monkeypatch.setitem(EVICT_RULES, NewestFirst.name, NewestFirst)  # the one registry line
    return NewestFirst.name


def held_columns(layer, row: int) -> set[int]:
    return set(layer.order[row][layer.valid[row]].tolist())


def test_a_registered_toy_rule_evicts_what_it_names(newest_first, tmp_path):
    model = tiny_llama()
    path = save_profile(profile_with(model, RATIOS, eviction=newest_first, sink_tokens=2, recent_window=2), tmp_path / "toy.yaml")
    profile = load_profile(path)  # no other list of rule names to extend: the registry is the one
    assert profile.method.eviction == newest_first
    inputs = left_pad(prompts([30, 21], seed=5))
    mask, positions = inputs["attention_mask"], inputs["attention_mask"].sum(dim=1, keepdim=True)
    evicted = 0
    with torch.no_grad(), attach(model, profile) as handle:
        cache = handle.new_cache()
        logits = model(**inputs, **with_cache(model, cache)).logits
        layers = cache.compressing_layers()
        assert all(type(layer.plan.evict) is NewestFirst for layer in layers.values())
        expected = {i: [held_columns(layer, b) for b in range(2)] for i, layer in layers.items()}
        tokens = {i: layer.tokens.copy() for i, layer in layers.items()}
        for _ in range(15):
            token = logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            logits = model(input_ids=token, attention_mask=mask, position_ids=positions, **with_cache(model, cache)).logits
            positions = positions + 1
            for i, layer in layers.items():
                newest = layer.seen - 1
                tokens[i] = tokens[i] + 1
                share = kept_count(RATIOS[i], tokens[i])
                for b in range(2):
                    held = expected[i][b] | {newest}
                    if len(held) > share[b]:
                        held.discard(max(c for c in held if c != newest))
                        evicted += 1
                    expected[i][b] = held
                    assert held_columns(layer, b) == held, (i, b)
    assert evicted > 0  # the budget pushed every layer over its share at some step
