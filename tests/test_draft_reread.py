"""A draft that rereads the prompt (`Draft.reread`, KVzip's reconstruction score).

Its reference is the prompt's own forward with its tokens appended as draft rows
(`KvtoolCache.set_draft`): they attend to the whole prompt and causally to each other, score it, and
are dropped. Then a draft drafts through that cache; a padded batch gives each row what it gets
alone; what cannot work is refused in one line.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtool.calibrate.cost import cheaper_drafts
from kvtool.cli.calibrate import parse_draft
from kvtool.errors import KvtoolError
from kvtool.profiles import Draft, read_profile, save_profile
from kvtool.runtime import KvtoolCache, attach
from kvtool.runtime.draft import drafted, prepare, with_draft
from kvtool.runtime.steps import Prompt
from kvtool.scoring import left_pad, prompt_forward
from test_draft import RULES, forced_logits, kept_columns
from test_runtime_rules import recipe_profile, rules_plans
from tiny_models import prompts, tiny_llama

K = 5
REREAD = Draft(0, reread=True)


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def prepared(model, batch, make, draft, rows=None):
    return prepare(model, batch, make, draft, rows=rows)


@pytest.mark.parametrize("case", list(RULES))
def test_the_reread_is_the_prompt_forward_with_its_own_tokens_appended(llama, case):
    profile = recipe_profile(llama)
    make = lambda: KvtoolCache(llama.config, rules_plans(profile, **RULES[case]))  # noqa: E731
    batch = left_pad([s.tolist() for s in prompts([38, 38], seed=11)], (0, 1), 0)
    with torch.no_grad(), attach(llama, profile):
        ready = prepared(llama, batch, make, REREAD, rows=2)  # both rows at once, as the reference runs them
        plain = make()
        assert torch.equal(ready.first_logits, prompt_forward(llama, batch, plain))  # the first token is the full cache's
        by_hand = make()
        by_hand.set_draft(batch.input_ids.shape[1])
        prompt_forward(llama, with_draft(batch, batch.input_ids), by_hand)
        assert kept_columns(ready.cache) == kept_columns(by_hand)
        if case == "shared-window-tova":  # a 4-row window, joined by 38 rows that reread: the scores change
            assert kept_columns(ready.cache) != kept_columns(plain)
        assert ready.prefix is None


def test_a_draft_after_the_reread_drafts_through_the_reread_cache(llama):
    """Widths: the prompt, its reread, the draft's one-token steps, the draft's rows; the draft is
    the greedy answer of the reread cache, and its rows change what is kept."""
    profile = recipe_profile(llama)
    make = lambda: KvtoolCache(llama.config, rules_plans(profile, **RULES["per-head-union-h2o"]))  # noqa: E731
    batch = left_pad([prompts([42], seed=4)[0].tolist()], (0,), 0)
    widths = []
    hook = llama.register_forward_pre_hook(lambda m, a, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    with torch.no_grad(), attach(llama, profile):
        try:
            both = prepared(llama, batch, make, Draft(K, reread=True))
        finally:
            hook.remove()
        reread = prepared(llama, batch, make, REREAD)
        draft_only = prepared(llama, batch, make, Draft(K))
        expected = drafted(llama, reread.cache, reread.first_logits, batch, K)
    assert widths == [42, 42, *([1] * (K - 1)), K]
    assert not torch.equal(expected, torch.zeros_like(expected))
    assert kept_columns(both.cache) != kept_columns(reread.cache)
    assert kept_columns(both.cache) != kept_columns(draft_only.cache)


@pytest.mark.parametrize("draft", [REREAD, Draft(K, 2, verify=True, reread=True)], ids=["reread", "reread+draft"])
def test_padded_batch_equals_single_runs(llama, draft):
    profile = recipe_profile(llama)
    make = lambda: KvtoolCache(llama.config, rules_plans(profile, **RULES["shared-window-tova"]))  # noqa: E731
    seqs = [s.tolist() for s in prompts([61, 37, 50], seed=3)]
    forced = torch.randint(3, 90, (3, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), attach(llama, profile):
        batch = left_pad(seqs, (0, 1, 2), 0)
        # Rows asked for all at once are still read again one at a time (they differ in length).
        ready = prepared(llama, batch, make, draft, rows=3)
        together = forced_logits(llama, ready.cache, ready.first_logits, batch, forced)
        for i, seq in enumerate(seqs):
            alone_batch = left_pad([seq], (i,), 0)
            alone = prepared(llama, alone_batch, make, draft)
            logits = forced_logits(llama, alone.cache, alone.first_logits, alone_batch, forced[i : i + 1])
            assert max((a[0] - b[i]).abs().max().item() for a, b in zip(logits, together)) < 1e-6, f"sequence {i}"
            for index, layer in ready.cache.compressing_layers().items():
                assert layer.kept[i] == alone.cache.layers[index].kept[0]


def test_a_prompt_with_images_is_refused(llama):
    ids = torch.ones(1, 8, dtype=torch.long)
    prompt = Prompt(ids, torch.ones_like(ids), torch.arange(8)[None], extras={"pixel_values": torch.zeros(1, 3, 4, 4)})
    with pytest.raises(KvtoolError, match="text prompt"):
        prepare(llama, prompt, lambda: None, REREAD)


def test_the_reread_round_trips_and_needs_no_tokens_only_with_reread(tmp_path):
    llama = tiny_llama()
    base = recipe_profile(llama)
    for draft in (REREAD, Draft(32, 2, True, reread=True)):
        profile = dataclasses.replace(base, method=dataclasses.replace(base.method, draft=draft))
        save_profile(profile, tmp_path / "p.yaml")
        assert read_profile(tmp_path / "p.yaml").method.draft == draft
    text = (tmp_path / "p.yaml").read_text().replace("reread: true", "reread: false").replace("tokens: 32", "tokens: 0")
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(KvtoolError, match="needs reread: true"):
        read_profile(tmp_path / "bad.yaml")
    # A draft without the reread writes no `reread` key: older files stay byte-identical.
    plain = dataclasses.replace(base, method=dataclasses.replace(base.method, draft=Draft(32, 2, True)))
    save_profile(plain, tmp_path / "plain.yaml")
    assert "reread" not in (tmp_path / "plain.yaml").read_text()


def test_the_cli_spec_and_the_cost_ladder():
    assert parse_draft("none,reread")[0] == REREAD
    assert parse_draft("32,rounds=2,verify,reread")[0] == Draft(32, 2, True, reread=True)
    assert parse_draft("none")[0] is None
    ladder = cheaper_drafts(Draft(32, 1, True, reread=True))
    assert ladder[-2:] == [REREAD, None] and all(d.reread for d in ladder[:-1])
    assert cheaper_drafts(Draft(8))[-2:] == [Draft(8), None]
