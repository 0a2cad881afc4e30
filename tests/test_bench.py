"""`kvtool bench`: the JSON contract, the per-layer ceiling, and bad input (no timing assertions)."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtool.bench import BenchConfig, long_prompts, run_bench
from kvtool.bench.config import MIN_PROMPT_TOKENS
from kvtool.cli.app import main
from kvtool.models import load_model
from kvtool.profiles import Draft, save_profile
from kvtool.runtime import uniform_profile
from kvtool.runtime.layer import GROWTH_SLOTS
from tiny_models import profile_with, tiny_gemma3

CACHE_KEYS = {"prefill_s", "decode_tok_s", "end_to_end_tok_s", "kv_bytes", "peak_memory_bytes", "prompt_peak_memory_bytes"}
RATIO_KEYS = {"decode_speedup", "decode_speedup_ceiling", "prefill_ratio", "kv_fraction"}
META_KEYS = {
    "model", "profile", "budget", "prompt_tokens", "batch", "new_tokens", "repeat",
    "torch_threads", "device", "peak_memory_method",
}
SMALL = ["--prompt-tokens", "48", "--new-tokens", "4", "--batch", "2", "--repeat", "1"]


def run_main(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, str, str]:
    """`kvtool ARGS` in this process (fast: torch is loaded once): exit status, stdout, stderr."""
    monkeypatch.setattr(sys, "argv", ["kvtool", *args])
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def bench_json(capsys, monkeypatch, model_dir: Path, *extra: str) -> dict:
    code, out, err = run_main(capsys, monkeypatch, "bench", str(model_dir), *SMALL, "--json", *extra)
    assert code == 0, err
    return json.loads(out)


def kv_heads_and_dim(model) -> tuple[int, int]:
    config = model.config
    return config.num_key_value_heads, config.hidden_size // config.num_attention_heads


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path):
    return load_model(str(tiny_llama_dir))


def test_json_contract_and_ratios_from_the_parts(capsys, monkeypatch, tiny_llama_dir: Path) -> None:
    report = bench_json(capsys, monkeypatch, tiny_llama_dir)
    assert set(report) >= META_KEYS | RATIO_KEYS | {"full", "compressed", "ceiling"}
    for name in ("full", "compressed", "ceiling"):
        assert set(report[name]) >= CACHE_KEYS
        part = report[name]
        assert part["prefill_s"] > 0 and part["decode_tok_s"] > 0 and part["peak_memory_bytes"] > 0
        assert 0 < part["prompt_peak_memory_bytes"] <= part["peak_memory_bytes"]
        assert len(part["runs"]) == report["repeat"]
        assert statistics.median(run["prefill_s"] for run in part["runs"]) == pytest.approx(part["prefill_s"])
        # End to end includes the prompt phase, so it is below the decode rate.
        assert 0 < part["end_to_end_tok_s"] < part["decode_tok_s"]
    full, comp, ceil = report["full"], report["compressed"], report["ceiling"]
    assert report["decode_speedup"] == pytest.approx(comp["decode_tok_s"] / full["decode_tok_s"])
    assert report["decode_speedup_ceiling"] == pytest.approx(ceil["decode_tok_s"] / full["decode_tok_s"])
    assert report["prefill_ratio"] == pytest.approx(comp["prefill_s"] / full["prefill_s"])
    assert report["kv_fraction"] == pytest.approx(comp["kv_bytes"] / full["kv_bytes"])
    # Default: budget 0.2 through the rule every command shares (no built-in profile for a
    # directory: calibrated on the packaged prompts first).
    assert report["budget"] == 0.2 and "calibrated now" in report["profile"]
    assert report["kv_fraction"] < 1
    assert (report["prompt_tokens"], report["new_tokens"], report["batch"], report["repeat"]) == (48, 4, 2, 1)
    assert report["device"] == "cpu" and report["torch_threads"] == torch.get_num_threads()
    assert "statm" in report["peak_memory_method"] or "ru_maxrss" in report["peak_memory_method"]


def test_side_by_side_decode_turns_and_its_ratios(capsys, monkeypatch, tiny_llama_dir: Path) -> None:
    """The three caches decode NEW_TOKENS steps each in turns of TURN_STEPS: 10 steps are two turns
    (8 + 2) per cache; the ratios are those of the turns' medians. `--no-side-by-side` skips it."""
    from kvtool.bench.measure import TURN_STEPS

    report = bench_json(capsys, monkeypatch, tiny_llama_dir, "--new-tokens", "10")
    paired = report["side_by_side"]
    assert paired["turn_steps"] == TURN_STEPS == 8
    for name in ("full", "compressed", "ceiling"):
        turns = paired["turns_tok_s"][name]
        assert len(turns) == 2 and all(t > 0 for t in turns)
        assert paired["decode_tok_s"][name] == pytest.approx(sum(turns) / 2)  # the median of two
    rates = paired["decode_tok_s"]
    assert paired["decode_speedup"] == pytest.approx(rates["compressed"] / rates["full"])
    assert paired["decode_speedup_ceiling"] == pytest.approx(rates["ceiling"] / rates["full"])
    # Each untimed prompt phase's tensor peak: the full cache's holds at least its prompt's keys and
    # values; the ceiling's is the full cache's forward, then its truncated copies.
    peaks = paired["prompt_tensor_peak_bytes"]
    prompt_kv = report["full"]["kv_bytes"] * 48 // (48 + 10)  # SMALL's prompt tokens, then 10 new ones
    assert peaks["full"] >= prompt_kv and peaks["ceiling"] >= peaks["full"] and peaks["compressed"] > 0
    assert bench_json(capsys, monkeypatch, tiny_llama_dir, "--no-side-by-side")["side_by_side"] is None


def test_the_side_by_side_kvtool_cache_decodes_what_a_run_decodes(tiny) -> None:
    """The side-by-side phase decodes through the kvtool cache in turns, re-attaching the model for each
    of its turns: the tokens must be those of one uninterrupted decode of the same cache."""
    from kvtool.bench.measure import decode_steps, prompt_phase
    from kvtool.runtime import attach

    model = tiny.model
    profile = uniform_profile(model, 0.3)
    ids = long_prompts(tiny.tokenizer, 40, 2)
    tokens = []
    for turns in ((12,), (5, 3, 4)):
        with torch.inference_mode(), attach(model, profile) as handle:
            state = prompt_phase(model, ids, handle.new_cache)
        seen = []
        for steps in turns:
            with torch.inference_mode(), attach(model, profile):
                for _ in range(steps):
                    decode_steps(model, state, 1)
                    seen.append(state.token)
        tokens.append(torch.cat(seen, dim=1))
        assert state.cache.layers[0].seen == 40 + 12  # every decode step fed one token
    assert torch.equal(tokens[0], tokens[1])


def test_full_cache_bytes_are_the_plain_cache(capsys, monkeypatch, tiny_llama_dir: Path, tiny) -> None:
    report = bench_json(capsys, monkeypatch, tiny_llama_dir, "--budget", "0.5")
    heads, dim = kv_heads_and_dim(tiny.model)
    layers = tiny.model.config.num_hidden_layers
    # The cache holds the prompt plus every fed token (the last chosen one is never fed).
    assert report["full"]["kv_slots"] == [48 + 4] * layers
    assert report["full"]["kv_bytes"] == layers * 2 * 2 * heads * (48 + 4) * dim * 4


def test_ceiling_keeps_each_layers_profile_share(capsys, monkeypatch, tiny_llama_dir: Path, tiny, tmp_path) -> None:
    ratios = [0.2, 0.6]
    path = save_profile(profile_with(tiny.model, ratios), tmp_path / "two-ratios.yaml")
    report = bench_json(capsys, monkeypatch, tiny_llama_dir, "--profile", str(path))
    n, new, batch = 48, 4, 2
    kept_after_prompt = [math.ceil(r * n) for r in ratios]
    # The truncated dense cache: each layer's prompt share, then every decoded token appended.
    assert report["ceiling"]["kv_slots"] == [k + new for k in kept_after_prompt]
    heads, dim = kv_heads_and_dim(tiny.model)
    assert report["ceiling"]["kv_bytes"] == sum(2 * batch * heads * (k + new) * dim * 4 for k in kept_after_prompt)
    # kvtool holds about as many entries per layer (ceil(R_l * T) plus its growth floor of 16 slots).
    slots = zip(kept_after_prompt, report["ceiling"]["kv_slots"], report["compressed"]["kv_slots"])
    for kept, ceiling, compressed in slots:
        assert kept <= compressed <= ceiling + GROWTH_SLOTS
    assert report["kv_fraction"] < 1 and report["budget"] == pytest.approx(sum(ratios) / len(ratios))


def test_sliding_window_layers_keep_their_window() -> None:
    model = tiny_gemma3()
    config = BenchConfig(prompt_tokens=40, new_tokens=3, batch=2, repeat=1)
    ids = torch.randint(3, 97, (config.batch, config.prompt_tokens))
    calls: list[str] = []
    profile = uniform_profile(model, 0.25)  # sliding layers: windows of ceil(0.25 * 7) = 2 entries
    result = run_bench(model, ids, profile, config, progress=calls.append)
    assert len(calls) == config.total_runs
    kinds = model.config.layer_types
    for index, kind in enumerate(kinds):
        full, ceiling = result.full.kv_slots[index], result.ceiling.kv_slots[index]
        if kind == "sliding_attention":
            # The window and the slot the newest token takes before the oldest goes: never grown past it.
            assert ceiling == full == 7 and result.compressed.kv_slots[index] == profile.layers[index].window + 1
        else:
            assert ceiling == math.ceil(0.25 * 40) + 3 < full
    assert result.kv_fraction < 1
    assert set(result.kv_fraction_by_type) == {"sliding_attention", "full_attention"}
    assert result.kv_fraction_by_type["sliding_attention"] < 0.5
    assert model.config._attn_implementation == "sdpa"  # detached afterwards


def test_long_prompts_are_distinct_windows_with_bos(tiny) -> None:
    ids = long_prompts(tiny.tokenizer, 300, 3)
    assert ids.shape == (3, 300) and ids.dtype == torch.long
    assert (ids[:, 0] == tiny.tokenizer.bos_token_id).all()
    assert not torch.equal(ids[0], ids[1]) and not torch.equal(ids[1], ids[2])


def test_text_report_has_the_three_rows_and_the_ratios(capsys, monkeypatch, tiny_llama_dir: Path) -> None:
    code, out, err = run_main(capsys, monkeypatch, "bench", str(tiny_llama_dir), *SMALL)
    assert code == 0, err
    for row in ("full", "kvtool", "truncated ceiling"):
        assert row in out
    assert "decode side by side (turns of 8 steps" in out and "decode in the runs:" in out
    assert "prompt phase:" in out and "of the full cache's bytes" in out and "peak memory:" in out
    code, out, err = run_main(capsys, monkeypatch, "bench", str(tiny_llama_dir), *SMALL, "--no-side-by-side")
    assert code == 0, err
    assert "decode: kvtool" in out and "side by side" not in out


def test_json_stdout_is_one_object_from_the_real_entry_point(tiny_llama_dir: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "from kvtool.cli.app import main; main()", "bench", str(tiny_llama_dir),
         "--prompt-tokens", "32", "--new-tokens", "2", "--batch", "1", "--repeat", "1", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert isinstance(json.loads(done.stdout), dict)
    assert done.stdout.count("\n") == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--budget", "0"], "error: budget must be a kept fraction in (0, 1]"),
        (["--budget", "1.5"], "error: budget must be a kept fraction in (0, 1]"),
        (["--prompt-tokens", str(MIN_PROMPT_TOKENS - 1)], "error: --prompt-tokens must be at least 16"),
        (["--prompt-tokens", "257"], "error: --prompt-tokens 257 is larger than the model's max_position_embeddings"),
        (["--prompt-tokens", "250", "--new-tokens", "10"], "error: --prompt-tokens 250 + --new-tokens 10 exceed"),
        (["--batch", "0"], "error: --batch must be at least 1"),
        (["--new-tokens", "0"], "error: --new-tokens must be at least 1"),
        (["--repeat", "0"], "error: --repeat must be at least 1"),
        (["--profile", "no/such/profile.yaml"], "error: profile file not found"),
    ],
)
def test_bad_input_is_one_error_line(capsys, monkeypatch, tiny_llama_dir: Path, args: list[str], message: str) -> None:
    code, out, err = run_main(capsys, monkeypatch, "bench", str(tiny_llama_dir), *args)
    assert code == 2 and out == ""
    assert err.startswith(message) and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_profile_for_another_model_is_refused(capsys, monkeypatch, tiny_llama_dir: Path, tmp_path: Path) -> None:
    path = save_profile(uniform_profile(tiny_gemma3(), 0.3), tmp_path / "other.yaml")
    code, out, err = run_main(capsys, monkeypatch, "bench", str(tiny_llama_dir), *SMALL, "--profile", str(path))
    assert code == 2 and out == ""
    assert err.startswith("error: profile is for") and len(err.strip().splitlines()) == 1


def test_a_draft_profile_benches_at_the_same_memory(capsys, monkeypatch, tiny_llama_dir: Path, tiny, tmp_path) -> None:
    """A draft adds a second prompt pass (counted in the prompt phase), never memory: the
    compressed cache holds the same slots as without it."""
    import dataclasses

    base = profile_with(tiny.model, [0.2, 0.6])
    plain = bench_json(capsys, monkeypatch, tiny_llama_dir, "--profile", str(save_profile(base, tmp_path / "plain.yaml")))
    drafted = dataclasses.replace(base, method=dataclasses.replace(base.method, draft=Draft(3)))
    report = bench_json(capsys, monkeypatch, tiny_llama_dir, "--profile", str(save_profile(drafted, tmp_path / "draft.yaml")))
    assert report["compressed"]["kv_slots"] == plain["compressed"]["kv_slots"]
    assert report["compressed"]["kv_bytes"] == plain["compressed"]["kv_bytes"]
    rounds = dataclasses.replace(base, method=dataclasses.replace(base.method, draft=Draft(3, rounds=2)))
    report = bench_json(capsys, monkeypatch, tiny_llama_dir, "--profile", str(save_profile(rounds, tmp_path / "rounds.yaml")))
    assert report["compressed"]["kv_slots"] == plain["compressed"]["kv_slots"]


def test_each_draft_round_is_timed_in_the_prompt_phase_of_the_bench(tiny) -> None:
    """`run_once` with a draft: one prompt forward, then per round the draft's steps and one forward
    of the draft's rows over the held prompt (never the prompt again), all before the first timed
    decode step."""
    import dataclasses

    from kvtool.bench.measure import run_once
    from kvtool.runtime import attach

    profile = profile_with(tiny.model, [0.2, 0.6])
    ids = torch.randint(3, tiny.model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(0))
    for rounds in (1, 2):
        widths = []
        hook = tiny.model.register_forward_pre_hook(lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
        try:
            with attach(tiny.model, dataclasses.replace(profile, method=dataclasses.replace(profile.method, draft=Draft(3)))) as handle:
                run_once(tiny.model, ids, 4, handle.bare_cache, draft=Draft(3, rounds), rows_at_once=len(ids))
        finally:
            hook.remove()
        assert widths == [30] + [1, 1, 3] * rounds + [1] * 4


def test_a_verified_draft_round_drafts_from_the_last_rounds_prefix(tiny) -> None:
    """With a verified draft, the bench's second draft is the one `kvtool.runtime.draft` drafts: the
    first round's verified prefix, then greedy through the cache that round scored."""
    import dataclasses

    from kvtool.bench.measure import run_once
    from kvtool.runtime import attach
    from kvtool.runtime.draft import drafted, prepare
    from kvtool.scoring import left_pad

    profile = profile_with(tiny.model, [0.2, 0.6])
    profile = dataclasses.replace(profile, method=dataclasses.replace(profile.method, draft=Draft(6, 2, verify=True)))
    ids = torch.randint(3, tiny.model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(0))
    scored = []
    hook = tiny.model.register_forward_pre_hook(
        lambda _, args, kwargs: scored.append(kwargs["input_ids"].clone()) if kwargs["input_ids"].shape[1] == 6 else None,
        with_kwargs=True,
    )
    try:
        with torch.no_grad(), attach(tiny.model, profile) as handle:
            run_once(tiny.model, ids, 2, handle.bare_cache, draft=Draft(6, 2, verify=True), rows_at_once=len(ids))
    finally:
        hook.remove()
    with torch.no_grad(), attach(tiny.model, profile) as handle:
        batch = left_pad(ids.tolist(), (0, 1), 0)
        ready = prepare(tiny.model, batch, handle.bare_cache, Draft(6, 1, verify=True), rows=len(ids))
        second = drafted(tiny.model, ready.cache, ready.first_logits, batch, 6, ready.prefix)
    assert len(scored) == 2
    assert torch.equal(scored[1], second)
