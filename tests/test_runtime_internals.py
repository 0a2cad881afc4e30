"""Importance, selection and merging invariants, memory held at the budget, unsupported modes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvtool.errors import KvtoolError
from kvtool.runtime import attach, uniform_profile
from kvtool.runtime.importance import attention_importance
from kvtool.runtime.layer import GROWTH_SLOTS
from kvtool.runtime.merge.position import nearest_anchor
from kvtool.runtime.selection import kept_count, select_tokens
from kvtool.models.forward import with_cache
from tiny_models import left_pad, profile_with, prompts, tiny_llama


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


# ----- importance -----------------------------------------------------------------------------


def eager_column_sums(model, ids: torch.Tensor) -> list[torch.Tensor]:
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_attentions=True)
    finally:
        model.set_attn_implementation("sdpa")
    return [att[0].sum(dim=1).mean(dim=0) for att in out.attentions]


@pytest.mark.parametrize("path", ["cpu-blocks", "portable-chunks"])
@pytest.mark.parametrize("lengths", [[33], [33, 20, 27]], ids=["unpadded", "padded"])
def test_chunked_importance_equals_eager_column_sums(llama, lengths, path, monkeypatch):
    from kvtool.runtime.importance import block_size, chunked, cpu_path

    # Tiny blocks and chunks so every prompt really is scored in several of them; the spies check it.
    monkeypatch.setattr(block_size, "BLOCK_ELEMENTS", 1)
    monkeypatch.setattr(chunked, "CHUNK_ELEMENTS", 500)
    if path == "portable-chunks":
        monkeypatch.setattr(cpu_path, "applies", lambda query: False)
    split = []  # (rows per block, rows to cover) of every call

    def spy(module, name, covered):
        real = getattr(module, name)

        def counted(*args):
            rows = real(*args)
            split.append((rows, covered(*args)))
            return rows

        monkeypatch.setattr(module, name, counted)

    spy(block_size, "block_rows", lambda n_heads, m, *probe: m)
    spy(chunked, "chunk_rows", lambda chunk_elements, row_elements: width)
    seqs = prompts(lengths)
    inputs = left_pad(seqs)
    width = inputs["input_ids"].shape[1]
    with torch.no_grad(), attach(llama, uniform_profile(llama, 1.0)) as handle:
        cache = handle.new_cache(record_importance=True)
        llama(**inputs, **with_cache(llama, cache))
    assert len(split) == len(llama.model.layers) * (len(seqs) if path == "cpu-blocks" else 1)
    assert all(rows < covered for rows, covered in split)
    for i, seq in enumerate(seqs):
        want = eager_column_sums(llama, seq[None])
        pad = width - len(seq)
        for layer, expected in enumerate(want):
            got = cache.layers[layer].prompt_importance[i]
            assert torch.allclose(got[pad:], expected, atol=1e-5, rtol=0)
            assert torch.all(got[:pad] == 0)
            assert not cache.layers[layer].prompt_valid[i, :pad].any()


def test_importance_function_chunking_is_exact():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 50, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, 50, 8, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 1, 50, 50, dtype=torch.bool).tril()
    mask[1, :, :, :7] = False  # left padding in sequence 1
    mask[1, :, :7, :] = False
    from kvtool.runtime.importance.chunked import chunked_attention

    whole = chunked_attention(q, k, None, mask, 0.3, 10**9)[1]
    chunked = chunked_attention(q, k, None, mask, 0.3, 300)[1]
    assert torch.allclose(attention_importance(q, k, mask, 0.3), whole, atol=1e-10)  # CPU blocked path
    assert torch.allclose(whole, chunked, atol=1e-12)
    assert torch.all(whole[1, :7] == 0)
    # Every real query row distributes probability 1, so the column sums total the real row count.
    assert torch.allclose(whole.sum(dim=1), torch.tensor([50.0, 43.0], dtype=torch.float64))


# ----- selection and merging -------------------------------------------------------------------


def brute_force(importance: np.ndarray, n_real: int, keep: int, sink: int, recent: int) -> list[int]:
    protected = list(range(min(sink, keep)))
    tail = [t for t in range(n_real - 1, n_real - 1 - recent, -1) if t not in protected]
    protected += tail[: keep - len(protected)]
    rest = sorted((t for t in range(n_real) if t not in protected), key=lambda t: -importance[t])
    return sorted(protected + rest[: keep - len(protected)])


@pytest.mark.parametrize("seed", range(10))
def test_selection_is_true_top_k_and_buckets_partition(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 60, size=4)
    width = int(lengths.max())
    importance = torch.zeros(4, width, dtype=torch.float64)
    valid = torch.zeros(4, width, dtype=torch.bool)
    for b, n in enumerate(lengths):
        importance[b, width - n:] = torch.from_numpy(rng.random(n))
        valid[b, width - n:] = True
    ratio = float(rng.uniform(0.05, 1.0))
    keep = kept_count(ratio, lengths)
    sel = select_tokens(importance, valid, keep, sink_tokens=2, recent_window=3)
    bucket = nearest_anchor(sel, valid)
    for b, n in enumerate(lengths):
        pad = width - n
        chosen = sel.index[b][sel.valid[b]].tolist()
        assert len(chosen) == keep[b] == math.ceil(ratio * n - 1e-9)  # budget met exactly
        assert [t - pad for t in chosen] == brute_force(importance[b, pad:].numpy(), n, keep[b], 2, 3)
        # every real token lands in exactly one bucket; padding in none; anchors in their own
        assert torch.all(bucket[b, :pad] == sel.index.shape[1])
        assert torch.all((bucket[b, pad:] >= 0) & (bucket[b, pad:] < keep[b]))
        for slot, anchor in enumerate(chosen):
            assert bucket[b, anchor] == slot


def test_every_layer_meets_its_ratio_exactly(llama):
    ratios = [0.15, 0.4, 0.7]
    seqs = prompts([64, 41, 9])
    profile = profile_with(llama, ratios, sink_tokens=2, recent_window=2)
    with torch.no_grad(), attach(llama, profile) as handle:
        cache = handle.new_cache()
        llama(**left_pad(seqs), **with_cache(llama, cache))
    lengths = np.array([len(s) for s in seqs])
    for layer, ratio in enumerate(ratios):
        expected = np.ceil(ratio * lengths - 1e-9).astype(int)
        kv = cache.layers[layer]
        assert kv.kept.tolist() == expected.tolist()
        assert kv.valid.sum(dim=1).tolist() == expected.tolist()


def test_share_table_equals_the_plans_keep_for_every_token_count():
    from kvtool.runtime.layer.grouped import RowShares
    from kvtool.runtime.layer import CompressingLayer, LayerPlan
    from kvtool.runtime.merge import merge_rule

    plan = LayerPlan(ratio=0.13, merge=merge_rule("none"), sink_tokens=2, recent_window=2, truncation_distance=8, min_kept=5)
    rows = RowShares(plan, np.array([0.13, 0.5, 0.02]), np.array([5, 0, 3]))
    for layer_plan in (plan, rows):
        layer = CompressingLayer(layer_plan)
        # Rows at different counts, and counts that outgrow the table (it is rebuilt wider).
        for start in (np.array([0, 7, 40]), np.array([511, 900, 3000])):
            layer.tokens = start.copy()
            for _ in range(40):
                assert layer._share_now().tolist() == layer_plan.keep(layer.tokens).tolist()
                layer.tokens = layer.tokens + 1
    # A batch of another size (a layer reused after a reorder) gets a table of its own width.
    layer = CompressingLayer(plan)
    layer.tokens = np.array([3, 4, 5])
    layer._share_now()
    layer.tokens = np.array([12, 30])
    assert layer._share_now().tolist() == plan.keep(layer.tokens).tolist()


def test_a_new_token_the_mask_marks_as_padding_is_not_kept(llama):
    from kvtool.runtime.layer import slots as layer_module  # where the last mask read is kept

    seqs = prompts([30, 22])
    inputs = left_pad(seqs)
    profile = profile_with(llama, [0.5, 0.3, 0.7], sink_tokens=2, recent_window=2)
    with torch.no_grad(), attach(llama, profile) as handle:
        cache = handle.new_cache()
        out = llama(**inputs, **with_cache(llama, cache))
        before = [(layer.tokens.copy(), layer.kept.copy()) for layer in cache.layers]
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        positions = inputs["attention_mask"].sum(dim=1, keepdim=True)
        # Row 1's new token is padding: every layer un-places it, row 0's is kept.
        mask = torch.cat([inputs["attention_mask"], torch.tensor([[1], [0]])], dim=1)
        llama(input_ids=token, attention_mask=mask, position_ids=positions, **with_cache(llama, cache))
        for layer, (tokens, kept) in zip(cache.layers, before):
            assert layer.tokens.tolist() == [tokens[0] + 1, tokens[1]]
            assert layer.kept[1] == kept[1] and layer.kept[0] >= kept[0]
            assert layer.valid.sum(dim=1).tolist() == layer.kept.tolist()
        # Every layer of that forward was handed one mask object, read once on the host.
        assert layer_module._last_mask[1] is not None and layer_module._last_mask[1].tolist() == [True, False]
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
        llama(input_ids=token, attention_mask=mask, position_ids=positions + 1, **with_cache(llama, cache))
        assert layer_module._last_mask[1] is None  # a new mask, all real: read again
        for layer, (tokens, _) in zip(cache.layers, before):
            assert layer.tokens.tolist() == [tokens[0] + 2, tokens[1] + 1]
            assert layer.valid.sum(dim=1).tolist() == layer.kept.tolist()


# ----- memory --------------------------------------------------------------------------------


def test_memory_stays_at_budget_through_long_generation(llama):
    ratios = [0.2, 0.35, 0.1]
    ids = prompts([200])[0][None]
    profile = profile_with(llama, ratios, sink_tokens=4, recent_window=8)
    slot_bytes = 2 * llama.config.num_key_value_heads * (64 // 4) * 8  # K and V, float64
    with torch.no_grad(), attach(llama, profile) as handle:
        cache = handle.new_cache()
        out = llama(input_ids=ids, **with_cache(llama, cache))
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        for step in range(257):
            seen = 200 + step
            for layer, ratio in enumerate(ratios):
                kv = cache.layers[layer]
                share = math.ceil(ratio * seen - 1e-9)
                assert kv.kept[0] <= share
                # physical K/V: the share plus at most GROWTH_SLOTS spare slots (the stated floor)
                assert kv.keys.shape[2] <= share + GROWTH_SLOTS
                assert kv.physical_bytes() <= (share + GROWTH_SLOTS) * (slot_bytes + 10)
                if step in (0, 256):
                    assert kv.full_bytes() == seen * slot_bytes
            out = llama(input_ids=token, **with_cache(llama, cache))
            token = out.logits[:, -1].argmax(-1, keepdim=True)


# ----- what an evicting cache cannot do ------------------------------------------------------


def test_unsupported_modes_fail_clearly(llama):
    assistant = tiny_llama(layers=1, seed=3)
    inputs = left_pad(prompts([40]))
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad(), attach(llama, uniform_profile(llama, 0.3)) as handle:
        # transformers >= 5.24 refuses a cache that cannot be cropped itself, before kvtool's crop would
        with pytest.raises((KvtoolError, ValueError), match="assisted decoding|[Aa]ssisted decoding requires a cache that can be cropped"):
            llama.generate(**inputs, **with_cache(llama, handle.new_cache()), assistant_model=assistant, **kwargs)
        with pytest.raises(KvtoolError, match="chunked prefill"):
            llama.generate(**inputs, **with_cache(llama, handle.new_cache()), prefill_chunk_size=8, **kwargs)
        with pytest.raises(ValueError, match="cache_implementation"):
            llama.generate(**inputs, **with_cache(llama, handle.new_cache()), cache_implementation="static", **kwargs)
        # generate never auto-compiles a cache that changes shape every step
        assert handle.new_cache().is_compileable is False
        cache = handle.new_cache()
        with pytest.raises(KvtoolError, match="attach"):
            # a kvtool cache driven by plain sdpa (not attached) never compresses: refused on the next step
            handle.detach()
            llama(**inputs, **with_cache(llama, cache))
            llama(input_ids=inputs["input_ids"][:, -1:], **with_cache(llama, cache))


def test_truncation_distance_can_be_retuned_on_a_copied_cache(llama):
    import copy

    ids = prompts([80])[0][None]
    steps = prompts([30], seed=5)[0]
    logits = {}
    for distance, retune in [(3, None), (25, 3)]:
        profile = profile_with(llama, 0.2, sink_tokens=2, recent_window=2, truncation_distance=distance)
        with torch.no_grad(), attach(llama, profile) as handle:
            cache = handle.new_cache()
            llama(input_ids=ids, **with_cache(llama, cache))
            if retune is not None:
                cache = copy.deepcopy(cache)
                cache.set_truncation_distance(retune)
            logits[distance] = torch.stack(
                [llama(input_ids=t.view(1, 1), **with_cache(llama, cache)).logits[0, -1] for t in steps]
            )
            with pytest.raises(KvtoolError, match="truncation distance"):
                cache.set_truncation_distance(7)
    assert torch.allclose(logits[3], logits[25], atol=1e-12)


@pytest.mark.parametrize("padded", [False, True])
def test_fused_prompt_attention_matches_sdpa(padded):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvtool.runtime.importance import attention_with_importance
    from kvtool.runtime.importance.chunked import chunked_attention

    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 40, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, 40, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 3, 40, 8, generator=g, dtype=torch.float64)
    mask, v_dirty = None, v.clone()
    if padded:
        mask = torch.ones(2, 1, 40, 40, dtype=torch.bool).tril()
        mask[1, :, :, :9] = False
        mask[1, :, :9, :] = False
        v_dirty[1, :, :9] = float("nan")  # what padded rows of an earlier layer may leave behind
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    want = sdpa_attention_forward(module, q, k, v, mask, scaling=0.35)[0]
    got, importance = attention_with_importance(q, k, v_dirty, mask, 0.35)
    chunked_out, chunked_importance = chunked_attention(q, k, v_dirty, mask, 0.35, 700)
    assert torch.allclose(got, chunked_out, atol=1e-12)  # the CPU blocked path and the portable one agree
    assert torch.allclose(importance, chunked_importance, atol=1e-10)
    real = slice(9, None) if padded else slice(None)
    assert torch.allclose(got[1, real], want[1, real], atol=1e-12)
    assert torch.allclose(got[0], want[0], atol=1e-12)
    assert torch.allclose(importance, attention_importance(q, k, mask, 0.35), atol=1e-12)
    if padded:
        assert torch.all(got[1, :9] == 0)


def test_interleaved_caches_each_reach_their_own_layers(llama):
    # Every forward carries its own cache to the attention function: stepping two caches in turn on
    # one model gives what stepping each alone gives.
    profile = profile_with(llama, [0.3, 0.5, 0.2], sink_tokens=2, recent_window=2)
    prompts_ab = prompts([50, 37], seed=7)
    steps = prompts([6], seed=8)[0]

    def run(ids_list):
        with torch.no_grad(), attach(llama, profile) as handle:
            caches = [handle.new_cache() for _ in ids_list]
            logits = [[llama(input_ids=ids[None], **with_cache(llama, c)).logits[0, -1]] for ids, c in zip(ids_list, caches)]
            for token in steps:
                for row, cache in zip(logits, caches):
                    row.append(llama(input_ids=token.view(1, 1), **with_cache(llama, cache)).logits[0, -1])
        return [torch.stack(row) for row in logits], caches

    together, caches = run(prompts_ab)
    for i, ids in enumerate(prompts_ab):
        alone, _ = run([ids])
        assert torch.equal(together[i], alone[0])
    assert [c.layers[0].seen for c in caches] == [50 + len(steps), 37 + len(steps)]


# ----- the cache argument's name ---------------------------------------------------------------


def test_both_cache_argument_names_compress_the_same(llama):
    """transformers 5.24 renamed `past_key_values` to `cache` (the old name still arrives through
    `generate` as `cache`): the hook finds a kvtool cache under either, so generation compresses
    under both and gives the same tokens; kvtool's own calls use the name the model declares."""
    from kvtool.models.forward import CACHE_NAMES, cache_keyword, passed_cache

    assert cache_keyword(llama) in CACHE_NAMES
    assert passed_cache({"past_key_values": 1}) == 1 and passed_cache({"cache": 2, "past_key_values": None}) == 2
    inputs = left_pad(prompts([40, 33]))
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    names = ["past_key_values"] + (["cache"] if cache_keyword(llama) == "cache" else [])
    outs, kept = [], []
    with torch.no_grad(), attach(llama, uniform_profile(llama, 0.3)) as handle:
        for name in names:
            cache = handle.new_cache()
            outs.append(llama.generate(**inputs, **{name: cache}, **kwargs))
            kept.append([int(layer.kept.max()) for layer in cache.compressing_layers().values()])
    assert all(torch.equal(outs[0], out) for out in outs)
    # Compressed: 30% of the 40-token prompt plus the new tokens' growth, far from 46 entries.
    assert all(max(k) < 30 for k in kept), kept


def test_a_model_that_drops_forward_kwargs_still_reaches_its_cache(llama, monkeypatch):
    """Some families' forwards do not pass keyword arguments on to the attention (Falcon since
    transformers 5.25): the forward's context variable carries the cache instead, so generation is
    the same, and it is cleared once each forward returns or raises."""
    from kvtool.runtime import attention

    inputs = left_pad(prompts([40, 33]))
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)

    def generate():
        with torch.no_grad(), attach(llama, uniform_profile(llama, 0.3)) as handle:
            out = llama.generate(**inputs, **with_cache(llama, handle.new_cache()), **kwargs)
            assert attention.FORWARD_CACHE.get() is None
            with pytest.raises(RuntimeError):  # float ids: the embedding raises inside the forward
                llama(input_ids=inputs["input_ids"].float(), **with_cache(llama, handle.new_cache()))
            assert attention.FORWARD_CACHE.get() is None
        return out

    expected = generate()
    forward = attention.kvtool_attention_forward

    def dropping(module, *args, **kw):
        kw.pop(attention.CACHE_KWARG, None)
        return forward(module, *args, **kw)

    monkeypatch.setattr(attention, "kvtool_attention_forward", dropping)
    assert torch.equal(generate(), expected)


def test_the_prompt_ranks_are_counted_while_held_and_freed_once_generation_starts(llama):
    """The compressed prompt's ranks (for re-freezing it with another truncation distance) are held
    only between the prompt and the first new token, and counted in the layer's bytes while held."""
    inputs = left_pad(prompts([40, 33]))
    with torch.no_grad(), attach(llama, uniform_profile(llama, 0.3)) as handle:
        cache = handle.new_cache()
        llama(**inputs, **with_cache(llama, cache))
        layer = cache.layers[0]
        rank = layer._prompt_rank
        assert rank is not None
        without = layer.physical_bytes() - rank.numel() * rank.element_size()
        assert without == sum(t.numel() * t.element_size() for t in (layer.keys, layer.values, layer.valid, layer.order,
                              layer.frozen, layer.score, layer.image, layer.attention) if t is not None)
        mask = torch.cat([inputs["attention_mask"], torch.ones(2, 1, dtype=torch.long)], dim=1)
        llama(input_ids=torch.tensor([[5], [6]]), attention_mask=mask, **with_cache(llama, cache))
        assert all(layer._prompt_rank is None for layer in cache.compressing_layers().values())
        with pytest.raises(KvtoolError, match="truncation distance"):
            cache.set_truncation_distance(4)
