"""A draft: tokens drafted through the compressed cache score the prompt again, then are dropped.

The draft reads the prompt each layer held aside (`runtime.held`); the reference it is checked
against here is the prompt's own forward with the draft appended (`KvtoolCache.set_draft`).

What a draft layer keeps after the second prompt forward is checked against an eager-attention
brute force for every rule in tests/test_runtime_rules.py (CASES, `draft` ids). Here: the two-pass
helper drafts exactly the plain compressed cache's greedy tokens and hands that draft to the second
cache; the first logits are the prompt's own (the first token is the full cache's); padded batches
equal single runs; the budget holds; what cannot work is refused in one line.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from kvtool.errors import KvtoolError
from kvtool.models.forward import with_cache
from kvtool.profiles import Draft
from kvtool.runtime import KvtoolCache, attach
from kvtool.runtime.draft import drafted, prepare, with_draft
from kvtool.scoring import left_pad, prompt_forward, step_tokens
from test_runtime_rules import RATIOS, recipe_profile, rules_plans
from tiny_models import profile_with, prompts, tiny_gemma3, tiny_llama

K = 5


def draft_prompt_forward(model, batch, make_cache, tokens, rounds=1):
    """The prepared cache and the prompt's last logits (`runtime.draft.prepare`; `tokens` 0: no draft)."""
    # The whole batch at once: these tests are about the draft (the default splits a CPU batch, test_row_groups).
    ready = prepare(model, batch, make_cache, Draft(tokens, rounds) if tokens else None, rows=len(batch.input_ids))
    return ready.cache, ready.first_logits
RULES = {
    "shared-window-tova": dict(heads="shared", scorer="window", window=4, pool=3, evict="tova"),
    "per-head-union-h2o": dict(heads="per-head", scorer="union", window=6, pool=7, evict="heavy-hitter"),
    "shared-sum-fixed-point": dict(heads="shared", scorer="attention-sum", evict="fixed-point"),
}


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def kept_columns(cache) -> dict[int, list]:
    out = {}
    for index, layer in cache.compressing_layers().items():
        order = layer.order if layer.per_head else layer.order[:, None]
        out[index] = [[sorted(order[b, h][layer.valid[b]].tolist()) for h in range(order.shape[1])] for b in range(order.shape[0])]
    return out


def forced_logits(model, cache, first, batch, tokens: torch.Tensor) -> list[torch.Tensor]:
    """The logits after the prompt and after each of `tokens` [B, L] fed one at a time."""
    seen = []

    def feed(t, logits):
        seen.append(logits.clone())
        return tokens[:, t] if t < tokens.shape[1] else None

    step_tokens(model, cache, first, batch, tokens.shape[1] + 1, feed)
    return seen


@pytest.mark.parametrize("case", list(RULES))
def test_the_draft_is_the_compressed_caches_own_greedy_tokens(llama, case):
    profile = recipe_profile(llama)
    plans = rules_plans(profile, **RULES[case])
    batch = left_pad([s.tolist() for s in prompts([40, 26], seed=5)], (0, 1), 0)
    make = lambda: KvtoolCache(llama.config, plans)  # noqa: E731
    with torch.no_grad(), attach(llama, profile):
        cache, first = draft_prompt_forward(llama, batch, make, K)
        plain = make()
        plain_first = prompt_forward(llama, batch, plain)
        assert torch.equal(first, plain_first)  # the prompt's own logits: the first token is the full cache's
        draft = drafted(llama, plain, plain_first, batch, K)
        assert draft.shape == (2, K)
        by_hand = make()
        by_hand.set_draft(K)
        prompt_forward(llama, with_draft(batch, draft), by_hand)
        assert kept_columns(cache) == kept_columns(by_hand)
        # ... and the draft changed what was kept.
        assert kept_columns(cache) != kept_columns(plain)
        for index, layer in cache.compressing_layers().items():
            n = batch.attention_mask.sum(dim=1)
            assert layer.seen == batch.input_ids.shape[1] == cache.get_seq_length()
            assert layer.kept.tolist() == [math.ceil(RATIOS[index] * int(t) - 1e-9) for t in n]
            assert max(max(cols) for head in kept_columns(cache)[index] for cols in head) < batch.input_ids.shape[1]


def test_a_later_round_drafts_through_the_cache_the_last_round_scored(llama):
    """Round two: the draft is the greedy tokens of round one's cache, and that draft scores a fresh
    prompt forward; round three the same from round two's. The first logits stay the prompt's own."""
    profile = recipe_profile(llama)
    batch = left_pad([s.tolist() for s in prompts([44, 29], seed=7)], (0, 1), 0)
    changed = []
    with torch.no_grad(), attach(llama, profile):
        for case in RULES.values():
            make = lambda: KvtoolCache(llama.config, rules_plans(profile, **case))  # noqa: E731
            last, first = draft_prompt_forward(llama, batch, make, K, rounds=1)
            for rounds in (2, 3):
                cache, again = draft_prompt_forward(llama, batch, make, K, rounds=rounds)
                assert torch.equal(again, first)
                by_hand = make()
                by_hand.set_draft(K)
                prompt_forward(llama, with_draft(batch, drafted(llama, last, first, batch, K)), by_hand)
                assert kept_columns(cache) == kept_columns(by_hand)
                for index, layer in cache.compressing_layers().items():
                    assert layer.kept.tolist() == by_hand.layers[index].kept.tolist()
                changed.append(kept_columns(cache) != kept_columns(last))
                last = cache
    assert any(changed)  # a later round's draft changes what is kept somewhere


@pytest.mark.parametrize("verify", [False, True])
def test_the_prompt_runs_once_and_the_draft_reads_it_held(llama, verify):
    """Two rounds: one forward of the prompt's width, then per round only one-token steps and one
    forward of the draft's rows; its logits are those of the prompt's forward with the draft appended
    (what verification reads), and no cache keeps the held prompt once it is prepared."""
    profile = recipe_profile(llama)
    plans = rules_plans(profile, **RULES["per-head-union-h2o"])
    batch = left_pad([s.tolist() for s in prompts([40, 26], seed=5)], (0, 1), 0)
    widths = []
    hook = llama.register_forward_pre_hook(lambda m, a, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        with torch.no_grad(), attach(llama, profile):
            ready = prepare(llama, batch, lambda: KvtoolCache(llama.config, plans), Draft(K, 2, verify), rows=len(batch.input_ids))
    finally:
        hook.remove()
    width = batch.input_ids.shape[1]
    assert widths.count(width) == 1 and widths.count(K) == 2 and set(widths) == {width, K, 1}
    assert all(layer.held is None for layer in ready.cache.layers)
    if verify:
        assert ready.prefix is not None and (ready.prefix.lengths >= 1).all()


def prepare_by_part(model, batch, make_cache, drafts):
    """`prepare` of `batch` (all rows at once) with each of `drafts` in turn, through a `part` that
    records what runs: (the parts in the order they ran, every forward's (part, input width), the last
    prepared cache)."""
    import contextlib

    current, seen, order, ready = [None], [], [], None

    @contextlib.contextmanager
    def part(name):
        current[0] = name
        order.append(name)
        yield
        current[0] = None

    hook = model.register_forward_pre_hook(lambda m, a, kw: seen.append((current[0], kw["input_ids"].shape[1])), with_kwargs=True)
    try:
        for draft in drafts:
            ready = prepare(model, batch, make_cache, draft, part=part, rows=len(batch.input_ids))
    finally:
        hook.remove()
    return order, seen, ready


def test_prepare_names_each_part_as_it_runs(llama):
    """`part` wraps every forward `prepare` runs, each in the part it belongs to (what benchmarks time
    by it): the prompt's forward, then per round the one-token steps and the draft rows' forward."""
    from kvtool.runtime import draft as drafting

    profile = recipe_profile(llama)
    plans = rules_plans(profile, **RULES["per-head-union-h2o"])
    batch = left_pad([s.tolist() for s in prompts([40, 26], seed=5)], (0, 1), 0)
    with torch.no_grad(), attach(llama, profile):
        order, seen, _ = prepare_by_part(llama, batch, lambda: KvtoolCache(llama.config, plans), [Draft(K, 2, True), None])
    assert order == [drafting.PROMPT_FORWARD, *[drafting.DRAFT_STEPS, drafting.DRAFT_ROWS] * 2, drafting.PROMPT_FORWARD]
    width = batch.input_ids.shape[1]
    assert seen == [(drafting.PROMPT_FORWARD, width), *([(drafting.DRAFT_STEPS, 1)] * (K - 1) + [(drafting.DRAFT_ROWS, K)]) * 2,
                    (drafting.PROMPT_FORWARD, width)]


def test_the_draft_rows_logits_equal_the_appended_forward(llama):
    """The draft's forward over the held prompt gives the logits the prompt's forward with the draft
    appended gives at the draft's positions (full attention over the whole prompt)."""
    from kvtool.runtime.draft import draft_logits
    from kvtool.runtime.held import HeldCache
    from kvtool.runtime.steps import prompt_logits

    profile = recipe_profile(llama)
    plans = rules_plans(profile, **RULES["shared-window-tova"])
    batch = left_pad([s.tolist() for s in prompts([33, 21], seed=9)], (0, 1), 0)
    draft = torch.randint(3, 90, (2, K), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), attach(llama, profile):
        cache = KvtoolCache(llama.config, plans)
        cache.hold_prompt()
        prompt_forward(llama, batch, cache)
        held = draft_logits(llama, batch, draft, HeldCache(llama.config, cache.take_held()), K)
        appended = prompt_logits(llama, with_draft(batch, draft), DynamicCache(config=llama.config), K)
    assert (held - appended).abs().max().item() < 1e-4


def test_no_draft_is_the_plain_prompt_forward(llama):
    profile = recipe_profile(llama)
    plans = rules_plans(profile, **RULES["shared-window-tova"])
    batch = left_pad([prompts([30], seed=2)[0].tolist()], (0,), 0)
    with torch.no_grad(), attach(llama, profile):
        cache, first = draft_prompt_forward(llama, batch, lambda: KvtoolCache(llama.config, plans), 0)
        plain = KvtoolCache(llama.config, plans)
        assert torch.equal(first, prompt_forward(llama, batch, plain))
        assert kept_columns(cache) == kept_columns(plain)


@pytest.mark.parametrize("rounds", [1, 2])
@pytest.mark.parametrize("case", list(RULES))
def test_padded_batch_equals_single_runs(llama, case, rounds):
    profile = recipe_profile(llama)
    plans = rules_plans(profile, **RULES[case])
    drafted_batch_equals_single_runs(llama, profile, plans, rounds)


def drafted_batch_equals_single_runs(model, profile, plans, rounds):
    """A padded batch prepared with a draft gives each row what it gets alone (logits of 24 forced
    tokens, and every layer's kept count); returns the batch's cache."""
    seqs = [s.tolist() for s in prompts([61, 37, 50], seed=3)]
    forced = torch.randint(3, 90, (3, 24), generator=torch.Generator().manual_seed(2))
    make = lambda: KvtoolCache(model.config, plans)  # noqa: E731
    with torch.no_grad(), attach(model, profile):
        batch = left_pad(seqs, (0, 1, 2), 0)
        cache, first = draft_prompt_forward(model, batch, make, K, rounds)
        together = forced_logits(model, cache, first, batch, forced)
        for i, seq in enumerate(seqs):
            alone_batch = left_pad([seq], (i,), 0)
            alone_cache, alone_first = draft_prompt_forward(model, alone_batch, make, K, rounds)
            alone = forced_logits(model, alone_cache, alone_first, alone_batch, forced[i : i + 1])
            diff = max((a[0] - b[i]).abs().max().item() for a, b in zip(alone, together))
            assert diff < 1e-6, f"sequence {i}"
            for index, layer in cache.compressing_layers().items():
                assert layer.kept[i] == alone_cache.layers[index].kept[0]  # the budget, held through the steps
    return cache


def test_a_draft_cannot_be_set_late(llama):
    profile = recipe_profile(llama)
    cache = KvtoolCache(llama.config, rules_plans(profile))
    with torch.no_grad(), attach(llama, profile):
        llama(input_ids=prompts([12])[0][None], use_cache=True, **with_cache(llama, cache))
    with pytest.raises(KvtoolError, match="before the prompt"):
        cache.set_draft(3)
    with pytest.raises(KvtoolError, match="draft tokens must be an integer >= 0"):
        KvtoolCache(llama.config, rules_plans(profile)).set_draft(-1)


def windowed_gemma_profile(gemma, draft=None, scored=False):
    """Tiny Gemma 3 with its sliding layers window-shaped (4 entries, 1 sink; `scored`: by score) and
    its full layers at 0.5."""
    import dataclasses

    base = profile_with(gemma, 0.5)
    layers = tuple(
        dataclasses.replace(layer, window=4, sinks=1, compress=False, ratio=1.0, scored=scored) if kind == "sliding_attention" else layer
        for kind, layer in zip(base.model.layer_types, base.layers)
    )
    return dataclasses.replace(base, layers=layers, method=dataclasses.replace(base.method, draft=draft))


def test_hybrid_models_draft_through_every_layer():
    """A profile with a draft makes every sliding layer kvtool's (its own window, or the profile's), so the
    draft's rows leave no layer; without a draft the sliding layers that keep their window stay transformers'."""
    from kvtool.runtime.attach import layer_plans

    gemma = tiny_gemma3()
    plain = profile_with(gemma, 0.5)
    cache = KvtoolCache(gemma.config, layer_plans(plain))
    with pytest.raises(KvtoolError, match="every layer to be a kvtool layer"):
        cache.set_draft(4)
    cache.set_draft(0)  # no draft: nothing to refuse
    import dataclasses

    drafted_profile = dataclasses.replace(plain, method=dataclasses.replace(plain.method, draft=Draft(K)))
    plans = layer_plans(drafted_profile)
    assert [plan.cap for plan in plans] == [7, None, 7, None]  # the model's own window - 1
    KvtoolCache(gemma.config, plans).set_draft(4)


def test_hybrid_draft_rows_read_the_held_prompt_as_the_appended_forward():
    from kvtool.runtime.attach import layer_plans
    from kvtool.runtime.draft import draft_logits
    from kvtool.runtime.held import HeldCache
    from kvtool.runtime.steps import prompt_logits

    gemma = tiny_gemma3()
    profile = windowed_gemma_profile(gemma)
    batch = left_pad([s.tolist() for s in prompts([33, 21], seed=9)], (0, 1), 0)
    draft = torch.randint(3, 90, (2, K), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), attach(gemma, profile):
        cache = KvtoolCache(gemma.config, layer_plans(profile))
        cache.hold_prompt()
        prompt_forward(gemma, batch, cache)
        held = draft_logits(gemma, batch, draft, HeldCache(gemma.config, cache.take_held()), K)
        appended = prompt_logits(gemma, with_draft(batch, draft), DynamicCache(config=gemma.config), K)
    assert (held - appended).abs().max().item() < 1e-9


@pytest.mark.parametrize("scored", [False, True], ids=["recent", "scored"])
@pytest.mark.parametrize("rounds", [1, 2])
def test_hybrid_padded_batch_equals_single_runs_with_a_draft(rounds, scored):
    from kvtool.runtime.attach import layer_plans

    gemma = tiny_gemma3()
    profile = windowed_gemma_profile(gemma, scored=scored)
    cache = drafted_batch_equals_single_runs(gemma, profile, layer_plans(profile), rounds)
    for index, layer in cache.compressing_layers().items():
        assert (layer.kept == layer.plan.keep(layer.tokens)).all()
        if layer.plan.cap is not None:
            assert layer.kept.max() == 4


@pytest.mark.parametrize("rounds", [1, 2])
def test_generate_with_a_draft_is_the_two_pass_greedy_text(tiny_llama_dir, rounds):
    """`generate(..., draft=k)` (transformers' generate around the second cache) writes what the
    step-by-step two passes write, per row of a padded batch; the cache it ends with holds the budget."""
    from kvtool.models.prompts import format_prompts
    from kvtool.runtime.generate import generate

    model, tokenizer, texts, profile, eos = tiny_generate_case(tiny_llama_dir)
    new = 12
    with attach(model, profile) as handle:
        result = generate(
            model, tokenizer, texts, max_new_tokens=new, cache_factory=handle.new_cache, draft=Draft(K, rounds)
        )
        plain = generate(model, tokenizer, texts, max_new_tokens=new, cache_factory=handle.new_cache)
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in format_prompts(tokenizer, texts)]
        batch = left_pad(ids, (0, 1), tokenizer.pad_token_id)
        with torch.no_grad():
            cache, first = draft_prompt_forward(model, batch, handle.new_cache, K, rounds)
            chosen = []
            step_tokens(model, cache, first, batch, new, lambda t, logits: chosen.append(logits.argmax(-1)) or chosen[-1])
    for row, output in enumerate(result.outputs):
        tokens = [int(step[row]) for step in chosen]
        cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
        assert output == tokenizer.decode(tokens[:cut], skip_special_tokens=True)
    assert result.outputs != plain.outputs  # the draft changed what was kept
    assert result.kv_bytes == plain.kv_bytes < 0.7 * result.kv_bytes_full
    assert result.new_tokens == plain.new_tokens


def test_draft_profile_through_the_cli(tiny_llama_dir, tmp_path):
    import dataclasses

    from kvtool.models import load_model
    from kvtool.profiles import save_profile
    from kvtool.runtime import uniform_profile
    from test_cli_generate_budget import generate_json

    base = uniform_profile(load_model(str(tiny_llama_dir)).model, 0.3)
    path = save_profile(dataclasses.replace(base, method=dataclasses.replace(base.method, draft=Draft(3))), tmp_path / "draft.yaml")
    shown = generate_json(tiny_llama_dir, "--profile", str(path))
    assert "prompt compressed with the attention of a 3-token draft" in shown["cache"] and "rounds" not in shown["cache"]
    assert shown["kv_bytes"] < 0.6 * shown["kv_bytes_full"]
    method = dataclasses.replace(base.method, draft=Draft(3, rounds=2))
    path = save_profile(dataclasses.replace(base, method=method), tmp_path / "rounds.yaml")
    assert "draft: {tokens: 3, rounds: 2, verify: false}" in path.read_text()
    shown = generate_json(tiny_llama_dir, "--profile", str(path))
    assert "prompt compressed with the attention of a 3-token draft (2 rounds)" in shown["cache"]


@pytest.mark.parametrize("draft", [Draft(4, rounds=2, verify=True), Draft(5), None], ids=["verified", "one-round", "none"])
def test_the_cli_and_the_python_api_give_the_same_answer(tiny_llama_dir, tmp_path, draft):
    """`kvtool generate --profile P` and `attach(model, P).generate(...)` write the same tokens, with
    the profile's draft or without; a bare cache (`new_cache`) is refused for a draft profile rather
    than silently skipping its draft."""
    import dataclasses

    from kvtool.models import load_model
    from kvtool.models.loader import eos_token_ids
    from kvtool.models.prompts import format_prompts
    from kvtool.profiles import save_profile
    from test_cli_generate_budget import PROMPTS, generate_json

    loaded = load_model(str(tiny_llama_dir))
    model, tokenizer = loaded.model, loaded.tokenizer
    profile = profile_with(model, 0.3, heads="per-head", scorer="window", window=2, pool=1, eviction="tova",
                           sink_tokens=0, recent_window=1)
    profile = dataclasses.replace(profile, method=dataclasses.replace(profile.method, draft=draft))
    shown = generate_json(tiny_llama_dir, "--profile", str(save_profile(profile, tmp_path / "p.yaml")))

    inputs = tokenizer(format_prompts(tokenizer, PROMPTS), return_tensors="pt", padding=True, add_special_tokens=False)
    eos = eos_token_ids(model, tokenizer)
    with attach(model, profile) as handle:
        out = handle.generate(**inputs, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        if draft is not None:
            with pytest.raises(KvtoolError, match="call handle.generate") as refused:
                handle.new_cache()
            assert "\n" not in str(refused.value)
            plain = model.generate(**inputs, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                   **with_cache(model, handle.bare_cache()))
    texts = []
    for row in out[:, inputs["input_ids"].shape[1]:].tolist():
        cut = next((i for i, t in enumerate(row) if t in eos), len(row))
        texts.append(tokenizer.decode(row[:cut], skip_special_tokens=True))
    assert texts == shown["outputs"]
    if draft is not None:
        assert not torch.equal(out, plain)  # the draft changed the answer: the Python path applied it


def tiny_generate_case(tiny_llama_dir):
    """The tiny Llama with its tokenizer, two prompts, a per-head TOVA profile at 0.3 and the EOS ids:
    the case the `generate`-with-a-draft tests run."""
    from kvtool.models import load_model
    from kvtool.models.loader import eos_token_ids

    loaded = load_model(str(tiny_llama_dir))
    model, tokenizer = loaded.model, loaded.tokenizer
    texts = ["alpha beta gamma " * 9 + "delta", "one two three four five six seven eight nine ten " * 3]
    profile = profile_with(model, 0.3, heads="per-head", scorer="window", window=2, pool=1, eviction="tova",
                           sink_tokens=0, recent_window=1)
    return model, tokenizer, texts, profile, eos_token_ids(model, tokenizer)


def test_the_draft_rows_positions_stay_on_the_prompts_device():
    # A GPU run found `with_draft` mixing a CPU arange with CUDA positions; the meta device stands
    # in for any device that is not the CPU.
    from kvtool.runtime.steps import Prompt

    ids = torch.ones(2, 5, dtype=torch.long, device="meta")
    whole = with_draft(Prompt.of({"input_ids": ids}), torch.ones(2, 3, dtype=torch.long))
    assert whole.position_ids.device.type == "meta" and whole.position_ids.shape == (2, 8)


def test_prompts_held_in_host_memory_prepare_the_same_cache(llama, monkeypatch):
    """On a GPU a draft's held prompts go to host memory and come back a layer at a time
    (runtime.layer.held_prompt). That path, its copies made here on the CPU, prepares exactly what
    holding them in place does: the same first logits, verified prefix and kept entries, also in a
    layer that keeps everything (it goes on writing into its prompt's tensors)."""
    from kvtool.runtime.layer import held_prompt

    class Copied:  # stands for the CUDA event that ends a copy out
        pass

    copies, fetched, arrived, events = [], [], [], []

    from kvtool.runtime.layer import pinned

    pool, allocated = pinned.PinnedPool(), []
    pool._allocate = lambda nbytes: allocated.append(nbytes) or torch.empty(nbytes, dtype=torch.uint8)
    monkeypatch.setattr(held_prompt, "POOL", pool)

    def to_host(*tensors):
        copies.append(len(tensors))
        return tuple(held_prompt.POOL.take(t.shape, t.dtype).copy_(t) for t in tensors), Copied()

    def to_device(keys, values, device):  # a copy back, started while the layer before computes
        fetched.append(keys)
        events.append("f")
        return keys.clone(), values.clone(), len(fetched)

    def arrive(copy, device):
        arrived.append(copy[2])
        events.append("a")
        return copy[0], copy[1]

    profile = profile_with(llama, [0.3, 1.0, 0.2], sink_tokens=1, recent_window=2, truncation_distance=3)
    plans = rules_plans(profile, **RULES["per-head-union-h2o"])
    batch = left_pad([s.tolist() for s in prompts([40, 26], seed=6)], (0, 1), 0)
    runs = []
    for on_host in (False, True, True):  # the second time from the first one's pinned buffers
        if on_host and not runs[1:]:
            monkeypatch.setattr(held_prompt, "held_on_host", lambda device: True)
            monkeypatch.setattr(held_prompt, "_to_host", to_host)
            monkeypatch.setattr(held_prompt, "_to_device", to_device)
            monkeypatch.setattr(held_prompt, "_arrived", arrive)
        with torch.no_grad(), attach(llama, profile):
            runs.append(prepare(llama, batch, lambda: KvtoolCache(llama.config, plans), Draft(K, 2, True), rows=len(batch.input_ids)))
    # 3 layers, 2 runs through host memory: one copy out per layer and run, and one copy back per
    # layer and round, each read once, in the order they were started.
    assert copies == [2] * 6 and len(fetched) == 6 * 2 and arrived == list(range(1, 6 * 2 + 1))
    # A layer's copy back is started before the layer before it is read: it runs while that one computes.
    assert "".join(events) == "ffafaa" * 4
    assert len(allocated) == 6 and pool.free_bytes == sum(allocated)  # given back, and taken again
    (place, host, again) = runs
    for a, b in zip(host.cache.layers, again.cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert torch.equal(place.first_logits, host.first_logits)
    assert torch.equal(place.prefix.tokens, host.prefix.tokens) and torch.equal(place.prefix.lengths, host.prefix.lengths)
    for a, b in zip(place.cache.layers, host.cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) and torch.equal(a.valid, b.valid)
    assert not place.cache.layers[1].compresses and place.cache.layers[0].compresses
