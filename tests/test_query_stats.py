"""Per-head query statistics: recorded by calibration, saved beside the profile, refused when wrong."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from kvtool.calibration.queries import record_query_stats
from kvtool.errors import KvtoolError
from kvtool.models.forward import with_cache
from kvtool.models.queries import query_taps
from kvtool.profiles import MethodSettings, read_profile, save_profile
from kvtool.profiles.queries import QueryStats, sidecar_path
from kvtool.runtime import attach, uniform_profile
from kvtool.scoring import make_batches
from test_profiles import assert_one_line_error, make_profile
from tiny_models import prompts, tiny_gemma3, tiny_llama


def stats_for(profile, seed: int = 0) -> QueryStats:
    g = torch.Generator().manual_seed(seed)
    heads, dim = profile.model.num_attention_heads, profile.model.head_dim
    root = torch.randn(3, heads, dim, dim, generator=g)
    pairs = torch.rand(3, heads, dim // 2, generator=g)
    return QueryStats((0, 1, 2), torch.randn(3, heads, dim, generator=g), root @ root.transpose(-1, -2), queries=1234, pair_norm=pairs)


def saved(tmp_path: Path):
    profile = make_profile()
    stats = stats_for(profile)
    path = save_profile(dataclasses.replace(profile, query_stats=stats), tmp_path / "p.yaml")
    return path, stats


def test_statistics_round_trip_beside_the_profile(tmp_path: Path) -> None:
    path, stats = saved(tmp_path)
    assert sidecar_path(path).exists()
    document = yaml.safe_load(path.read_text())
    assert document["queries"]["file"] == "p.queries.safetensors"
    assert document["queries"]["future_positions"] == 512
    loaded = read_profile(path)
    assert loaded.query_stats.layers == (0, 1, 2) and loaded.query_stats.queries == 1234
    torch.testing.assert_close(loaded.query_stats.mean, stats.mean)
    # Covariances are stored in float16: a relative error of float16's precision.
    torch.testing.assert_close(loaded.query_stats.cov.float(), stats.cov, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(loaded.query_stats.pair_norm, stats.pair_norm)


def test_a_sidecar_has_the_same_bytes_however_safetensors_ordered_its_header(tmp_path: Path) -> None:
    """safetensors writes its metadata in hash order, which changes from process to process: the
    sidecar's header is written sorted, so the same statistics always get the same file and digest
    (and a profile saved again names the same file)."""
    import json

    from kvtool.profiles.queries import _canonical

    path, _ = saved(tmp_path)
    data = sidecar_path(path).read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    assert list(header) == sorted(header) and list(header["__metadata__"]) == sorted(header["__metadata__"])
    reordered = {key: (dict(reversed(value.items())) if key == "__metadata__" else value) for key, value in reversed(header.items())}
    text = json.dumps(reordered).encode()
    text += b" " * (-len(text) % 8)
    scrambled = len(text).to_bytes(8, "little") + text + data[8 + size :]
    assert scrambled != data and _canonical(scrambled) == data
    again = save_profile(read_profile(path), tmp_path / "again.yaml")
    assert sidecar_path(again).read_bytes() == data
    assert yaml.safe_load(again.read_text())["queries"]["sha256"] == yaml.safe_load(path.read_text())["queries"]["sha256"]


def test_statistics_without_pair_norms_still_load(tmp_path: Path) -> None:
    """A sidecar written before the pair norms were recorded loads with none (TriAttention then
    refuses in one line; the other rules read what is there)."""
    profile = make_profile()
    stats = dataclasses.replace(stats_for(profile), pair_norm=None)
    path = save_profile(dataclasses.replace(profile, query_stats=stats), tmp_path / "p.yaml")
    loaded = read_profile(path).query_stats
    assert loaded.pair_norm is None and loaded.pair_norms(0) is None
    torch.testing.assert_close(loaded.mean, stats.mean)


def test_a_profile_without_statistics_writes_no_sidecar(tmp_path: Path) -> None:
    path = save_profile(make_profile(), tmp_path / "p.yaml")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.yaml"]
    assert "queries" not in yaml.safe_load(path.read_text())
    assert read_profile(path).query_stats is None


def test_an_altered_sidecar_is_refused_in_one_line(tmp_path: Path) -> None:
    path, _ = saved(tmp_path)
    side = sidecar_path(path)
    data = bytearray(side.read_bytes())
    data[-1] ^= 1
    side.write_bytes(bytes(data))
    with pytest.raises(KvtoolError) as info:
        read_profile(path)
    assert_one_line_error(info.value, "SHA-256")


def test_a_missing_sidecar_is_refused_in_one_line(tmp_path: Path) -> None:
    path, _ = saved(tmp_path)
    sidecar_path(path).unlink()
    with pytest.raises(KvtoolError) as info:
        read_profile(path)
    assert_one_line_error(info.value, "query statistics", "p.queries.safetensors")


def refusal_after_editing(tmp_path: Path, section: str, key: str, value) -> KvtoolError:
    """The error reading a saved profile gives once its YAML's `section.key` says `value`."""
    path, _ = saved(tmp_path)
    document = yaml.safe_load(path.read_text())
    document[section][key] = value
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    with pytest.raises(KvtoolError) as info:
        read_profile(path)
    return info.value


def test_statistics_of_another_shape_are_refused(tmp_path: Path) -> None:
    error = refusal_after_editing(tmp_path, "model", "num_attention_heads", 4)  # the sidecar still says 8
    assert_one_line_error(error, "8 query heads", "4")


def test_a_sidecar_outside_the_profiles_folder_is_refused(tmp_path: Path) -> None:
    error = refusal_after_editing(tmp_path, "queries", "file", "../elsewhere.safetensors")
    assert_one_line_error(error, "beside the profile")


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
def test_recorded_statistics_are_the_real_rows_mean_and_covariance(make) -> None:
    """A padded batch records exactly its real rows: the same statistics as the prompts one by one,
    and those are the brute-force mean and covariance of the hooked queries."""
    model = make()
    seqs = prompts([9, 14])
    batch = make_batches([s.tolist() for s in seqs], 2, 0)
    stats = record_query_stats(model, batch)
    singles = make_batches([s.tolist() for s in seqs], 1, 0)
    alone = record_query_stats(model, singles)
    torch.testing.assert_close(stats.mean, alone.mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats.cov, alone.cov, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats.pair_norm, alone.pair_norm, rtol=1e-5, atol=1e-6)
    assert stats.queries == 23
    layer = stats.layers[-1]
    tap = query_taps(model)[layer]
    rows = []
    hook = tap.module.register_forward_hook(lambda m, a, out: rows.append(tap.shape(out, out_len[0])))
    try:
        for s in seqs:
            out_len = [len(s)]
            with torch.no_grad():
                model(s[None])
    finally:
        hook.remove()
    queries = torch.cat([r[0] for r in rows]).double()  # [23, Hq, D]
    mean = queries.mean(dim=0)
    centred = queries - mean
    cov = torch.einsum("mhd,mhe->hde", centred, centred) / queries.shape[0]
    torch.testing.assert_close(stats.mean[-1].double(), mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats.cov[-1].double(), cov, rtol=1e-5, atol=1e-6)
    half = queries.shape[-1] // 2
    pairs = (queries[..., :half] ** 2 + queries[..., half:] ** 2).sqrt().mean(dim=0)  # RoPE's pairs: i with i + D/2
    torch.testing.assert_close(stats.pair_norm[-1].double(), pairs, rtol=1e-5, atol=1e-6)
    types = getattr(model.config, "layer_types", None)
    assert stats.layers == tuple(i for i in range(model.config.num_hidden_layers) if not types or types[i] == "full_attention")


def test_expected_attention_without_statistics_is_a_one_line_error() -> None:
    model = tiny_llama()
    profile = uniform_profile(model, 0.3, MethodSettings(scorer="expected-attention"))
    handle = attach(model, profile)
    try:
        with pytest.raises(KvtoolError) as info, torch.no_grad():
            model(prompts([20])[0][None], **with_cache(model, handle.new_cache()))
    finally:
        handle.detach()
    assert_one_line_error(info.value, "query statistics")


@pytest.mark.parametrize(
    "scorer, eviction",
    [
        ("expected-attention", "tova"), ("expected-output", "tova"), ("attention-sum", "expected-attention"),
        ("triattention", "tova"), ("attention-sum", "triattention"),
    ],
)
def test_a_calibrated_expected_attention_profile_is_saved_loaded_and_applied(tmp_path: Path, scorer: str, eviction: str) -> None:
    """Calibration records the statistics, ships them with a profile whose scorer or generation rule
    reads them, and the loaded profile generates as the one calibration returned."""
    from kvtool.calibration.recipes import SearchSpace
    from kvtool.calibration.runner import calibrate
    from kvtool.runtime import load_profile
    from test_calibrate import loaded, word_prompts

    model = tiny_llama(dtype=torch.float32)
    space = SearchSpace(
        evictions=(eviction,), selections=("importance",), scorers=(scorer,), ratio_sources=("uniform",),
        heads=("shared",), recent_shares=(0.0,), merge_modes=("none",), distances=(0,), seeds=(),
    )
    start = MethodSettings(scorer=scorer, eviction=eviction, merge="none", ratios="uniform")
    run = calibrate(
        loaded(model), 0.3, data=word_prompts(4), samples=4, seed=1, reference_tokens=4, candidates=(0,),
        search=space, method=start, draft=None, out=tmp_path / "ea.yaml",
    )
    assert run.profile.method.scorer == scorer and run.profile.method.eviction == eviction
    assert run.profile.query_stats is not None
    assert sidecar_path(tmp_path / "ea.yaml").exists()
    profile = load_profile(tmp_path / "ea.yaml")
    torch.testing.assert_close(profile.query_stats.mean, run.profile.query_stats.mean)
    ids = prompts([40])[0][None]
    outputs = []
    for p in (run.profile, profile):
        with torch.no_grad(), attach(model, p) as handle:
            outputs.append(handle.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False))
    # Float16 covariances change scores only in their last digits: the same tokens are kept.
    assert torch.equal(outputs[0], outputs[1])


def test_the_expected_attention_generation_rule_without_statistics_is_refused() -> None:
    model = tiny_llama()
    profile = uniform_profile(model, 0.3, MethodSettings(eviction="expected-attention"))
    with pytest.raises(KvtoolError) as info:
        attach(model, profile)
    assert_one_line_error(info.value, "query statistics")


def test_models_the_scorer_cannot_run_on_are_named() -> None:
    from kvtool.models.queries import unsupported
    from tiny_vlms import tiny_gemma3_vlm, tiny_llava, tiny_qwen2_vl

    assert "multimodal RoPE" in unsupported(tiny_qwen2_vl().model)
    for model in (tiny_llama(), tiny_gemma3(), tiny_llava().model, tiny_gemma3_vlm().model):
        assert unsupported(model) is None


def test_calibration_leaves_the_scorer_out_where_it_cannot_run(monkeypatch) -> None:
    """The search tries every scorer the model can run; asking for this one there is a one-line error."""
    import kvtool.calibration.runner as runner
    from kvtool.calibration.recipes import SearchSpace
    from test_calibrate import loaded, word_prompts

    monkeypatch.setattr(runner, "unsupported", lambda model: "tiny: no RoPE the scorer can read")
    model = loaded(tiny_llama(dtype=torch.float32))
    space = SearchSpace(
        evictions=("tova",), selections=("importance",), scorers=("attention-sum", "expected-attention"),
        ratio_sources=("uniform",), heads=("shared",), recent_shares=(0.0,), merge_modes=("none",), distances=(0,), seeds=(),
    )
    run = runner.calibrate(model, 0.3, data=word_prompts(4), samples=4, seed=1, reference_tokens=4, candidates=(0,), search=space)
    assert {t.scorer for t in run.profile.calibration.recipes} == {"attention-sum"}
    with pytest.raises(KvtoolError) as info:
        runner.calibrate(model, 0.3, data=word_prompts(4), samples=4, reference_tokens=4, candidates=(0,), search=space,
                         method=MethodSettings(scorer="expected-attention"))
    assert_one_line_error(info.value, "no RoPE the scorer can read")
    with pytest.raises(KvtoolError):
        runner.calibrate(model, 0.3, data=word_prompts(4), samples=4, reference_tokens=4, candidates=(0,),
                         search=dataclasses.replace(space, scorers=("expected-attention",)))


def test_a_tap_reads_every_query_layout_even_with_as_many_positions_as_heads() -> None:
    from kvtool.models.queries import QueryTap

    tap = QueryTap(torch.nn.Identity(), heads=4, head_dim=3)
    for tokens in (4, 7):
        q = torch.randn(2, tokens, 4, 3)  # [B, n, Hq, D]
        assert torch.equal(tap.shape(q, tokens), q)
        assert torch.equal(tap.shape(q.reshape(2, tokens, 12), tokens), q)  # the bare projection
        assert torch.equal(tap.shape(q.transpose(1, 2) * 1.0, tokens), q)  # heads first (Gemma 3), a norm's output


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
def test_the_full_pass_learns_the_statistics_it_then_scores_by(make) -> None:
    """With references, calibration learns the statistics in the full pass's own prompt forwards (no
    forward of their own) and scores the kept prompt states afterwards: the statistics of plain
    forwards (to rounding), the expected-attention curves of a pass handed them, and recorded scores
    that compress a prompt as a pass handed them would."""
    from kvtool.calibration.passes import full_pass
    from kvtool.calibration.queries import QueryRecorder

    model = make()
    batches = make_batches([s.tolist() for s in prompts([19, 26, 23])], 2, 0)
    answers = [[None] * len(b.rows) for b in batches]
    expected = MethodSettings(scorer="expected-attention")
    tri = MethodSettings(scorer="triattention")
    common = dict(reference_tokens=3, with_references=True, scorers=(MethodSettings(), expected, tri))
    tokenizer = type("Tok", (), {"pad_token_id": 0, "eos_token_id": 2})()
    learned = full_pass(model, tokenizer, batches, answers, MethodSettings(), queries=QueryRecorder(model), **common)
    stats = record_query_stats(model, batches)
    torch.testing.assert_close(learned.query_stats.mean, stats.mean, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(learned.query_stats.cov, stats.cov, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(learned.query_stats.pair_norm, stats.pair_norm, rtol=1e-6, atol=1e-8)
    assert learned.query_stats.queries == stats.queries == 68
    given = full_pass(model, tokenizer, batches, answers, MethodSettings(), query_stats=learned.query_stats, **common)
    for key in ("attention-sum", "expected-attention", "triattention"):
        a, b = learned.stats_by_scorer[key], given.stats_by_scorer[key]
        assert a.layers == b.layers
        np.testing.assert_allclose(a.curves, b.curves, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(a.gini, b.gini, rtol=1e-9, atol=1e-12)
    for ours, theirs in zip(learned.states, given.states):
        for index, layer in ours.full_cache.compressing_layers().items():
            other = theirs.full_cache.compressing_layers()[index]
            torch.testing.assert_close(layer.prompt_scores.expected, other.prompt_scores.expected, rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(layer.prompt_scores.triattention, other.prompt_scores.triattention, rtol=1e-9, atol=1e-12)
