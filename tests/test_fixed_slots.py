"""Fixed slots (runtime/layer/fixed.py) and the decoder that replays them as a CUDA graph (runtime/graphed.py).

There is no CUDA graph on a CPU, so these tests check what a graph needs and what it would replay:
- the fixed-slot step decodes what the eager step decodes (tokens, logits, every layer's entries and
  counters), for every generation rule, both head modes and a left-padded batch;
- it is replayable: the host counters stand still (a replay cannot update them), no state tensor is
  replaced (a replay writes the captured buffers), and on the meta device no operation reads a
  tensor on the host or copies one from it (each would wait for a GPU, and fails a capture).
benchmarks/cuda_check.py compares the captured graph with the eager steps on a GPU.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvtool.errors import KvtoolError
from kvtool.profiles import MethodSettings
from kvtool.profiles.queries import QueryStats
from kvtool.runtime import attach, uniform_profile
from kvtool.runtime.graphed import Decoder
from kvtool.runtime.importance.decode import SLOT_CHUNK, SPLIT_FROM
from kvtool.runtime.steps import Prompt, prompt_forward
from tiny_models import left_pad, prompts, tiny_llama

STEPS = 30

RECIPES = {
    "shipped: heavy-hitter, per-head, union": MethodSettings(eviction="heavy-hitter", heads="per-head", scorer="union", window=4, pool=3),
    "fixed-point, shared": MethodSettings(eviction="fixed-point", truncation_distance=6),
    "tova, per-head": MethodSettings(eviction="tova", heads="per-head"),
    "tova, shared": MethodSettings(eviction="tova"),
    "heavy-hitter-window, shared": MethodSettings(eviction="heavy-hitter-window", window=4, pool=3),
    "sliding, per-head": MethodSettings(eviction="sliding", heads="per-head"),
    "prompt-only": MethodSettings(eviction="prompt-only"),
    "expected-attention, per-head": MethodSettings(eviction="expected-attention", heads="per-head"),
    "expected-attention, shared": MethodSettings(eviction="expected-attention"),
    "triattention, per-head": MethodSettings(eviction="triattention", heads="per-head", scorer="triattention"),
}


def recipe_profile(model, recipe: str):
    """`uniform_profile` at 0.3 with the recipe's rules, and random query statistics where they read them."""
    profile = uniform_profile(model, 0.3, RECIPES[recipe])
    if not recipe.startswith(("expected-attention", "triattention")):
        return profile
    g = torch.Generator().manual_seed(2)
    layers, heads, dim = model.config.num_hidden_layers, model.config.num_attention_heads, model.config.head_dim
    root = torch.randn(layers, heads, dim, dim, generator=g) / dim
    mean = torch.randn(layers, heads, dim, generator=g)
    pairs = torch.hypot(mean[..., : dim // 2], mean[..., dim // 2 :]) + torch.rand(layers, heads, dim // 2, generator=g)
    stats = QueryStats(tuple(range(layers)), mean, root @ root.transpose(-1, -2), 100, pair_norm=pairs)
    return dataclasses.replace(profile, query_stats=stats)


@pytest.fixture(scope="module")
def model():
    model = tiny_llama(dtype=torch.float64, layers=3, seed=3)
    with torch.no_grad():  # sharper attention, so the rules' choices differ between entries
        for layer, scale in zip(model.model.layers, (30.0, 8.0, 1.0)):
            layer.self_attn.q_proj.weight.mul_(scale)
    return model


def _prompt(lengths: list[int]) -> Prompt:
    return Prompt.of(left_pad(prompts(lengths, seed=5)))


def _decode(model, profile, prompt: Prompt, mode: str, steps: int = STEPS, check=None):
    """Greedy steps through a fresh kvtool cache; returns the tokens, the logits and the cache."""
    with torch.inference_mode(), attach(model, profile) as handle:
        cache = handle.new_cache()
        logits = prompt_forward(model, prompt, cache)
        decoder = Decoder(model, cache, steps, mode)
        position = prompt.next_positions
        tokens, seen = [], []
        for step in range(steps):
            token = logits.argmax(-1, keepdim=True)
            tokens.append(token)
            if check is not None:
                check(cache, step)
            logits = decoder(token, position + step).clone()
            seen.append(logits)
        decoder.close()
    return torch.cat(tokens, dim=1), torch.stack(seen), cache


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("lengths", [[40], [40, 27]], ids=["one row", "left-padded"])
def test_fixed_slots_decode_what_the_eager_steps_decode(model, recipe: str, lengths: list[int]) -> None:
    profile = recipe_profile(model, recipe)
    prompt = _prompt(lengths)
    eager_tokens, eager_logits, eager = _decode(model, profile, prompt, "eager")
    fixed_tokens, fixed_logits, fixed = _decode(model, profile, prompt, "fixed")
    assert torch.equal(eager_tokens, fixed_tokens)
    torch.testing.assert_close(fixed_logits, eager_logits, rtol=1e-9, atol=1e-9)
    for a, b in zip(eager.layers, fixed.layers):
        # The same slots hold the same entries: placement and eviction move them alike.
        assert np.array_equal(a.kept, b.kept) and np.array_equal(a.tokens, b.tokens) and a.seen == b.seen
        # The buffers differ in their spare slots (eager grows by GROWTH_SLOTS, fixed sizes once).
        width = min(a.keys.shape[2], b.keys.shape[2])
        assert not a.valid[:, width:].any() and not b.valid[:, width:].any()
        assert torch.equal(a.valid[:, :width], b.valid[:, :width])
        valid = a.valid[:, :width] if a.order.dim() == 2 else a.valid[:, None, :width]
        assert torch.equal(a.order[..., :width].masked_fill(~valid, -1), b.order[..., :width].masked_fill(~valid, -1))
        keys = a.valid[:, None, :width].expand(-1, a.keys.shape[1], -1)
        torch.testing.assert_close(b.keys[:, :, :width][keys], a.keys[:, :, :width][keys])
        torch.testing.assert_close(b.values[:, :, :width][keys], a.values[:, :, :width][keys])
        if a.score is not None:
            torch.testing.assert_close(
                b.score[..., :width].masked_fill(~valid, 0), a.score[..., :width].masked_fill(~valid, 0), rtol=1e-9, atol=1e-9
            )


def test_the_slots_hold_the_budget_through_a_long_generation(model) -> None:
    """Memory stays at the budget: the buffer is sized once, each row keeps its share, no more."""
    profile = uniform_profile(model, 0.2, RECIPES["shipped: heavy-hitter, per-head, union"])
    prompt = _prompt([60, 45])

    def check(cache, step):
        for layer in cache.layers:
            if layer.fixed is None:
                return
            share = layer.fixed.share[layer.fixed.tokens, layer.fixed.rows]
            assert not (layer.fixed.kept > share).any()  # every row within its share after each step
            assert torch.equal(layer.valid.sum(dim=1), layer.fixed.kept)  # and exactly its entries valid

    _, _, cache = _decode(model, profile, prompt, "fixed", steps=120, check=check)
    tokens = np.array([60 + 120, 45 + 120])  # every step fed one token
    for layer in cache.layers:
        assert np.array_equal(layer.kept, layer.plan.keep(tokens))
        # Sized for the last share plus one (whole chunks of the GPU decode attention from SPLIT_FROM on).
        assert layer.keys.shape[2] == int(layer.plan.keep(tokens).max()) + 1 < SPLIT_FROM


def test_fixed_steps_leave_the_host_alone_and_keep_their_buffers(model) -> None:
    """What a replay cannot do: update a host counter or write into a new tensor."""
    profile = uniform_profile(model, 0.3, RECIPES["shipped: heavy-hitter, per-head, union"])
    prompt = _prompt([40, 27])
    names = ("keys", "values", "valid", "order", "frozen", "score", "image")
    first: dict = {}

    def check(cache, step):
        for index, layer in enumerate(cache.layers):
            if layer.fixed is None:
                return
            state = (
                layer.seen, layer.tokens.tolist(), layer.kept.tolist(),
                {name: getattr(layer, name).data_ptr() for name in names if getattr(layer, name) is not None},
                {f.name: getattr(layer.fixed, f.name).data_ptr() for f in dataclasses.fields(layer.fixed)},
            )
            assert first.setdefault(index, state) == state

    _decode(model, profile, prompt, "fixed", check=check)
    assert first  # the check saw fixed layers


class _HostReads(TorchDispatchMode):
    """Records operations that read a tensor's values on the host or take a host tensor into a
    device's (here: the meta device standing in for a GPU)."""

    READS = {"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "item", "unique_dim", "_unique2"}

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        flat = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if name in self.READS:
            self.found.append(name)
        elif any(t.device.type == "meta" for t in flat) and any(t.device.type == "cpu" and t.dim() > 0 for t in flat):
            self.found.append(f"{name} (a host tensor)")
        out = func(*args, **kwargs)
        if any(t.device.type == "meta" for t in flat) or name.startswith("_to_copy"):
            leaves = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
            if name == "_to_copy" and any(t.device.type == "cpu" for t in flat) and any(o.device.type == "meta" for o in leaves):
                self.found.append("_to_copy (host to device)")
        return out


def _to_meta(cache, meta_model) -> None:
    rotary = meta_model.model.rotary_emb
    for layer in cache.layers:
        for name, value in list(vars(layer).items()):
            if isinstance(value, torch.Tensor):
                setattr(layer, name, value.to("meta"))
        layer.fixed = type(layer.fixed)(**{f.name: getattr(layer.fixed, f.name).to("meta") for f in dataclasses.fields(layer.fixed)})
        queries = layer.plan.queries
        if queries is not None:  # as the meta model's own statistics and rotary embedding would be
            queries = dataclasses.replace(queries.to("meta"), rotation=dataclasses.replace(queries.rotation, rotary=rotary))
            layer.plan = dataclasses.replace(layer.plan, queries=queries)


@pytest.mark.parametrize(
    "recipe", [
        "shipped: heavy-hitter, per-head, union", "fixed-point, shared", "tova, per-head", "expected-attention, per-head",
        "triattention, per-head",
    ]
)
def test_a_fixed_step_never_waits_for_the_device(model, recipe: str) -> None:
    """The step a CUDA graph captures must not read the GPU's values on the host or copy host data in.
    The meta device has no values: a step that read one fails there, and the dispatch mode records
    any host tensor a step takes in."""
    profile = recipe_profile(model, recipe)
    prompt = _prompt([40, 27])
    meta_model = copy.deepcopy(model).to("meta")
    with torch.inference_mode(), attach(model, profile) as handle:
        cache = handle.new_cache()
        prompt_forward(model, prompt, cache)
        decoder = Decoder(model, cache, 8, "fixed")
    decoder.model = meta_model
    # Not in inference mode, which copies host data in below the dispatch mode's sight.
    with torch.no_grad(), attach(meta_model, profile):
        _to_meta(cache, meta_model)
        token = torch.zeros(2, 1, dtype=torch.long, device="meta")
        position = torch.zeros(2, 1, dtype=torch.long, device="meta")
        with _HostReads() as reads:
            for _ in range(3):
                decoder(token, position)
    assert reads.found == []


@pytest.mark.parametrize("read", ["item", "host tensor in", "host data in"])
def test_the_host_reads_detector_sees_each_kind_of_read(read: str) -> None:
    """The detector above is not blind."""
    with torch.no_grad(), _HostReads() as reads:
        x = torch.ones(3, device="meta")
        if read == "item":
            with pytest.raises(RuntimeError):
                bool(x.any())
        elif read == "host tensor in":
            x.add_(torch.ones(3))
        else:
            x.add_(torch.as_tensor(np.ones(3), device="meta"))
    assert reads.found


def test_release_gives_the_eager_steps_back(model) -> None:
    """Fixed slots for some steps, then eager steps: the tokens of eager steps throughout."""
    profile = uniform_profile(model, 0.3, RECIPES["tova, per-head"])
    prompt = _prompt([40, 27])
    eager_tokens, _, _ = _decode(model, profile, prompt, "eager", steps=20)
    with torch.inference_mode(), attach(model, profile) as handle:
        cache = handle.new_cache()
        logits = prompt_forward(model, prompt, cache)
        tokens = []
        for mode, steps, start in (("fixed", 8, 0), ("eager", 12, 8)):
            decoder = Decoder(model, cache, steps, mode)
            for step in range(start, start + steps):
                token = logits.argmax(-1, keepdim=True)
                tokens.append(token)
                logits = decoder(token, prompt.next_positions + step)
            decoder.close()
    assert torch.equal(torch.cat(tokens, dim=1), eager_tokens)


def test_fixed_slots_refuse_what_they_cannot_hold(model) -> None:
    profile = uniform_profile(model, 0.3, RECIPES["fixed-point, shared"])
    prompt = _prompt([40])
    with torch.inference_mode(), attach(model, profile) as handle:
        cache = handle.new_cache()
        with pytest.raises(KvtoolError, match="prompt forward first"):
            cache.fix_slots(4)
        logits = prompt_forward(model, prompt, cache)
        decoder = Decoder(model, cache, 2, "fixed")
        for step in range(2):
            logits = decoder(logits.argmax(-1, keepdim=True), prompt.next_positions + step)
        with pytest.raises(KvtoolError, match="more decode steps"):
            decoder(logits.argmax(-1, keepdim=True), prompt.next_positions + 2)
        with pytest.raises(KvtoolError, match="cannot reorder"):
            cache.reorder_cache(torch.tensor([0]))
        with pytest.raises(KvtoolError, match="unknown decode mode"):
            Decoder(model, cache, 2, "fast")
        with pytest.raises(KvtoolError, match="CUDA"):
            Decoder(model, cache, 2, "graph")


@pytest.mark.parametrize("verify", [False, True])
def test_the_drafts_steps_through_fixed_slots_draft_what_eager_steps_draft(model, monkeypatch, verify: bool) -> None:
    """On a GPU the draft's steps replay a CUDA graph (runtime.steps.step_tokens); here the fixed-slot
    steps it replays run eagerly: the same draft, the same verified prefix, the same compressed cache."""
    from kvtool.profiles import Draft
    from kvtool.runtime import graphed, steps
    from kvtool.runtime.draft import prepare

    profile = uniform_profile(model, 0.3, RECIPES["shipped: heavy-hitter, per-head, union"])
    prompt = _prompt([40, 27])
    draft = Draft(6, rounds=2, verify=verify)
    results = []
    for fixed in (False, True):
        used = []
        if fixed:
            def mode(cache, device):
                used.append(graphed.graph_applies(cache, torch.device("cuda")))
                return "fixed" if used[-1] else "eager"
            monkeypatch.setattr(steps, "default_mode", mode)
        with torch.inference_mode(), attach(model, profile) as handle:
            results.append(prepare(model, prompt, handle.bare_cache, draft))
        if fixed:
            assert used and all(used)  # every round's steps took the fixed slots
    eager, fixed = results
    if verify:
        assert torch.equal(eager.prefix.tokens, fixed.prefix.tokens) and torch.equal(eager.prefix.lengths, fixed.prefix.lengths)
    for a, b in zip(eager.cache.layers, fixed.cache.layers):
        assert np.array_equal(a.kept, b.kept)
        assert torch.equal(a.order, b.order)


@pytest.mark.parametrize("lengths", [[40], [40, 27]], ids=["one row", "left-padded"])
def test_fixed_slots_decode_scored_windows_as_the_eager_steps(lengths: list[int], monkeypatch) -> None:
    """A hybrid model's scored windows (TOVA's rule inside the model's window) step through fixed slots
    as they step eagerly, past the windows' first departures."""
    import dataclasses
    import importlib

    from tiny_models import tiny_gemma3

    monkeypatch.setattr(importlib.import_module("kvtool.runtime.attach"), "SCORED_WINDOW_ROWS", 2)
    gemma = tiny_gemma3()
    base = uniform_profile(gemma, 0.3, RECIPES["tova, shared"])
    profile = dataclasses.replace(base, layers=tuple(
        dataclasses.replace(layer, window=4, sinks=1, compress=False, ratio=1.0, scored=True) if kind == "sliding_attention" else layer
        for kind, layer in zip(base.model.layer_types, base.layers)
    ))
    prompt = _prompt(lengths)
    eager_tokens, eager_logits, eager = _decode(gemma, profile, prompt, "eager")
    fixed_tokens, fixed_logits, fixed = _decode(gemma, profile, prompt, "fixed")
    assert torch.equal(eager_tokens, fixed_tokens)
    torch.testing.assert_close(fixed_logits, eager_logits, rtol=1e-9, atol=1e-9)
    for a, b in zip(eager.layers, fixed.layers):
        assert np.array_equal(a.kept, b.kept) and a.seen == b.seen
