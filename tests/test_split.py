"""`runtime.split`: each row of a left-padded batch's prompt phase, split off, is the cache that row's
prompt alone leaves (every attribute of every layer), and decodes as that cache does."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvtool.errors import KvtoolError
from kvtool.models.forward import with_cache
from kvtool.profiles import Draft
from kvtool.runtime import attach
from kvtool.runtime.draft import prepare
from kvtool.runtime.split import split_rows, splittable
from kvtool.runtime.steps import Prompt
from test_serve_helpers import prompt_ids, tiny_loaded
from tiny_models import profile_with, prompts, tiny_deepseek

LENGTHS = [40, 25, 60, 33]
DRAFT = Draft(tokens=6, rounds=2, verify=True)
# (budget, method settings, rows the prompt phase runs at once (None: all of them), layer fields)
CASES = {
    "shared": (0.5, {}, None, {}),
    "draft": (0.5, {"draft": DRAFT}, None, {}),
    "full": (1.0, {}, None, {}),  # every layer keeps every entry: a padded row's free slots come first
    "per-head-tova": (0.5, {"heads": "per-head", "eviction": "tova"}, None, {}),
    # Rows prepared two at a time and joined (`row_groups.join_caches`, the CPU's default with a draft).
    "draft-row-groups": (0.5, {"draft": DRAFT}, 2, {}),
    "per-head-tova-draft-row-groups": (0.5, {"heads": "per-head", "eviction": "tova", "draft": DRAFT}, 2, {}),
    "int8-storage": (0.5, {}, None, {"keys_format": "int8", "values_format": "int8"}),
}


def _padded(rows: list[list[int]]) -> Prompt:
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return Prompt.of({"input_ids": ids, "attention_mask": mask})


def _same(a, b, where: str) -> None:
    """`a` equals `b`: exactly, floats up to a batch's rounding."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype, (where, a.shape, b.shape)
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=where)
        else:
            assert torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), (where, a, b)
    elif isinstance(a, tuple) and a and isinstance(a[0], torch.Tensor):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.device)):
        assert a == b, (where, a, b)
    else:
        assert type(a) is type(b), where  # plans, storage, rules: the same objects' kinds


def _same_cache(split, alone, where: str) -> None:
    assert len(split.layers) == len(alone.layers)
    for i, (x, y) in enumerate(zip(split.layers, alone.layers)):
        assert type(x) is type(y) and set(vars(x)) == set(vars(y)), where
        for name in vars(y):
            _same(getattr(x, name), getattr(y, name), f"{where} layer {i}.{name}")
    _same(split.image_mask, alone.image_mask, f"{where} image_mask")


def _step(model, cache, token: int, position: int) -> torch.Tensor:
    out = model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[position]]), use_cache=True,
                **with_cache(model, cache))
    return out.logits[0, -1]


def _check_split(model, profile, rows: list[list[int]], at_once: int | None) -> None:
    """Each row of `rows`' batched prompt phase under `profile`, split off, is its prompt phase alone."""
    handle = attach(model, profile)
    draft = profile.method.draft
    try:
        with torch.inference_mode():
            batch = prepare(model, _padded(rows), handle.bare_cache, draft, rows=at_once or len(rows))
            split = split_rows(batch.cache, handle.bare_cache)
            assert len(split) == len(rows)
            for b, (ids, mine) in enumerate(zip(rows, split)):
                alone = prepare(model, Prompt.of({"input_ids": torch.tensor([ids])}), handle.bare_cache, draft)
                torch.testing.assert_close(batch.first_logits[b], alone.first_logits[0], rtol=1e-4, atol=1e-4)
                if draft is not None:
                    assert torch.equal(batch.prefix.tokens[b], alone.prefix.tokens[0])
                    assert batch.prefix.lengths[b] == alone.prefix.lengths[0]
                _same_cache(mine, alone.cache, f"row {b} after the prompt")
                # Greedy steps through each (past the buffer's growth and the eviction's first moves).
                token, position = int(alone.first_logits[0].argmax()), len(ids)
                for _ in range(20):
                    ours, theirs = _step(model, mine, token, position), _step(model, alone.cache, token, position)
                    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
                    token, position = int(theirs.argmax()), position + 1
                _same_cache(mine, alone.cache, f"row {b} after 20 steps")
    finally:
        handle.detach()


@pytest.mark.parametrize("case", list(CASES))
def test_each_split_row_is_its_prompt_alone_and_decodes_so(case) -> None:
    budget, method, at_once, fields = CASES[case]
    loaded = tiny_loaded()
    profile = profile_with(loaded.model, budget, **method)
    profile = dataclasses.replace(profile, layers=tuple(dataclasses.replace(layer, **fields) for layer in profile.layers))
    rows = [prompt_ids(loaded.tokenizer, n, seed=i) for i, n in enumerate(LENGTHS)]
    _check_split(loaded.model, profile, rows, at_once)


def test_latent_attention_rows_split_too() -> None:
    """DeepSeek-V3's latent layers (layer/latent.py) keep their expansion in each row's layer."""
    model = tiny_deepseek()
    _check_split(model, profile_with(model, 0.5), [p.tolist() for p in prompts(LENGTHS)], None)


def test_only_a_kvtool_cache_right_after_its_prompt_splits() -> None:
    loaded = tiny_loaded()
    model = loaded.model
    handle = attach(model, profile_with(model, 0.5))
    try:
        assert not splittable(object()) and splittable(handle.bare_cache())
        with pytest.raises(KvtoolError, match="after its prompt phase"):
            split_rows(handle.bare_cache(), handle.bare_cache)
        rows = [prompt_ids(loaded.tokenizer, n, seed=i) for i, n in enumerate(LENGTHS[:2])]
        with torch.inference_mode():
            ready = prepare(model, _padded(rows), handle.bare_cache, None)
            ready.cache.batch_select_indices(torch.tensor([0]))  # one row left, a step fed to it
            _step(model, ready.cache, 5, len(rows[0]))
            with pytest.raises(KvtoolError, match="before any new token"):
                split_rows(ready.cache, handle.bare_cache)
    finally:
        handle.detach()
