"""`kvtool calibrate` and `kvtool inspect gini` through the CLI, and one real-model stability check."""

from __future__ import annotations

import importlib.util
import json
import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtool.calibration.runner import calibrate
from kvtool.data import load_jsonl
from kvtool.cli.app import main
from kvtool.profiles import read_profile
from cli_runner import run

WORDS = "the cat dog sat on mat and it ran away to house big small red blue green one two three".split()
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None




@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = random.Random(5)
    path = tmp_path_factory.mktemp("data") / "words.jsonl"
    lines = [json.dumps({"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 50)))}) for _ in range(5)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def calibrated(tiny_llama_dir: Path, data_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A profile written by the CLI (module-scoped: one calibration for the inspect tests)."""
    out = tmp_path_factory.mktemp("profiles") / "tmp.yaml"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["kvtool", "calibrate", str(tiny_llama_dir), "--budget", "0.3", "--samples", "3",
                                    "--data", str(data_file), "--out", str(out)])
        main()
    return out


def test_calibrate_writes_a_profile_and_summarises(
    tiny_llama_dir: Path, data_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    out = tmp_path / "tmp.yaml"
    code, stdout, stderr = run(
        monkeypatch, capsys, "calibrate", str(tiny_llama_dir), "--budget", "0.3", "--samples", "3",
        "--data", str(data_file), "--out", str(out), "--seed", "4",
    )
    assert code == 0, stderr
    profile = read_profile(out)
    assert profile.budget == 0.3 and profile.calibration.samples == 3 and profile.calibration.seed == 4
    for heading in ("Per-layer KV budget", "Recipe search", "Recipe ", "Held out", "Calibration PPL", "Time"):
        assert heading in stdout
    # PrefixKV's retention level, or where measured-loss ratios came from.
    assert ("Retention p" in stdout) != (profile.method.ratios == "measured" and "measured loss on" in stdout)
    # One table row per recipe tried, exactly one marked chosen; the start is the papers' recipe.
    tried = profile.calibration.recipes
    assert len(re.findall(r"[0-9]\.[0-9]{3} \*", stdout)) == 1
    assert tried[0].stage == "start" and re.search(r"│ start\s+│ fixed-point D25 · attention-sum", stdout)
    assert "importance" in stderr and "recipes" in stderr and "held-out" in stderr  # the progress bars
    # `kvtool inspect profile` shows the same table from the file.
    code, shown, stderr = run(monkeypatch, capsys, "inspect", "profile", str(out))
    assert code == 0, stderr
    assert "Recipe search" in shown and f"{len(tried)} recipes tried on" in shown


def test_space_option_changes_what_the_search_tries(
    tiny_llama_dir: Path, data_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    out = tmp_path / "tmp.yaml"
    code, _, stderr = run(
        monkeypatch, capsys, "calibrate", str(tiny_llama_dir), "--budget", "0.3", "--samples", "3",
        "--data", str(data_file), "--out", str(out), "--space", "pools=31", "--space", "window_shares=0.5,0.7",
        "--space", "recent_shares=0",
    )
    assert code == 0, stderr
    tried = read_profile(out).calibration.recipes
    # The scorer stage tries each pooled scorer at every pool width and share of the space (a
    # seed's own settings, such as TOVA's one row, may differ).
    pooled = [t for t in tried if t.stage.startswith("scorer") and t.scorer in ("window", "union")]
    assert pooled and {t.pool for t in pooled} == {31}
    assert {t.window_share for t in pooled if t.scorer == "union"} == {0.5, 0.7}
    assert not any(t.stage.startswith("recent") for t in tried)  # one recent share: nothing to try


def test_draft_stage_is_shown_and_recorded(
    tiny_llama_dir: Path, data_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    out = tmp_path / "tmp.yaml"
    code, stdout, stderr = run(
        monkeypatch, capsys, "calibrate", str(tiny_llama_dir), "--budget", "0.3", "--samples", "4",
        "--data", str(data_file), "--out", str(out), "--draft", "4,stage",
        # Few other rules, so the search measures the pick's neighbours in the two the stage varies
        # (a later round retries only what came close, which could leave it none).
        "--space", "recent_shares=0", "--space", "pools=3", "--space", "selections=importance",
        "--space", "scorers=window", "--space", "heads=shared",
    )
    assert code == 0, stderr
    assert "Draft stage" in stdout and "PPL with the draft on" in stdout and "draft stage" in stderr
    drafted = [t for t in read_profile(out).calibration.recipes if t.drafted_ppl is not None]
    assert len(drafted) >= 2  # the pick and at least one other rule or ratio source
    code, shown, stderr = run(monkeypatch, capsys, "inspect", "profile", str(out))
    assert code == 0 and "with draft" in shown, stderr
    # Without a draft there is nothing to measure it with: one line, no file.
    out.unlink()
    code, _, stderr = run(
        monkeypatch, capsys, "calibrate", str(tiny_llama_dir), "--budget", "0.3", "--samples", "4",
        "--data", str(data_file), "--out", str(out), "--draft", "0,stage",
    )
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and "needs --draft above 0" in stderr and not out.exists()


def test_papers_recipe_tunes_only_d_and_merge(
    tiny_llama_dir: Path, data_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    out = tmp_path / "tmp.yaml"
    code, stdout, stderr = run(
        monkeypatch, capsys, "calibrate", str(tiny_llama_dir), "--budget", "0.3", "--samples", "3",
        "--data", str(data_file), "--out", str(out), "--seed", "4", "--papers",
    )
    assert code == 0, stderr
    method = read_profile(out).method
    assert (method.scorer, method.heads, method.eviction, method.recent_share) == ("attention-sum", "shared", "fixed-point", 0.0)
    for distance in (0, 8, 16, 25, 48, 96):
        assert re.search(rf"│\s+{distance}( \*)?\s+│\s+[0-9.]+\s+│", stdout), f"no PPL row for D={distance}"
    assert len(re.findall(r"│\s+\d+ \*\s+│", stdout)) == 1  # exactly one chosen D
    assert "importance" in stderr and "truncation" in stderr  # the progress bars


def test_default_out_is_profiles_model_budget(
    tiny_llama_dir: Path, data_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, stderr = run(
        monkeypatch, capsys, "calibrate", str(tiny_llama_dir), "--budget", "0.5", "--samples", "2",
        "--data", str(data_file),
    )
    assert code == 0, stderr
    assert (tmp_path / "profiles" / f"{tiny_llama_dir.name}-b0.5.yaml").is_file()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--budget", "0"], "error: budget must be a kept fraction in (0, 1]"),
        (["--budget", "1.5"], "error: budget must be a kept fraction in (0, 1]"),
        (["--budget", "0.3", "--samples", "9"], "error: asked for 9 samples but"),
        (["--budget", "0.3", "--out", "{tmp}/file/p.yaml"], "error: cannot write profile to"),
        (["--budget", "0.3", "--out", "{tmp}"], "error: cannot write profile to"),
        (["--budget", "0.3", "--reference-tokens", "0"], "error: reference tokens and batch size must be at least 1"),
        (["--budget", "0.3", "--space", "pools"], "error: --space takes FIELD=V1,V2"),
        (["--budget", "0.3", "--space", "nosuch=1"], "error: unknown --space field 'nosuch'"),
        (["--budget", "0.3", "--space", "window_shares=half"], "error: --space window_shares: 'half' is not a number"),
        (["--budget", "0.3", "--space", "pools=8"], "error: pool widths must be odd integers >= 1, got [8]"),
        (["--budget", "0.3", "--space", "scorers=nosuch"], "error: unknown scorer 'nosuch'"),
        (["--budget", "0.3", "--papers", "--space", "pools=7"], "error: --space changes the recipe search"),
    ],
)
def test_bad_input_is_one_line_and_leaves_no_file(
    tiny_llama_dir: Path, data_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, args, message
) -> None:
    (tmp_path / "file").write_text("a file, not a directory")
    monkeypatch.chdir(tmp_path)
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    code, stdout, stderr = run(monkeypatch, capsys, "calibrate", str(tiny_llama_dir), "--data", str(data_file), *args)
    assert code == 2 and stdout == ""
    assert stderr.startswith(message) and len(stderr.strip().splitlines()) == 1, stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_default_out_path() -> None:
    from kvtool.cli.calibrate import default_out_path

    assert default_out_path("smollm2", 0.2) == Path("profiles/smollm2-b0.2.yaml")
    assert default_out_path("/models/tiny-llama/", 0.5) == Path("profiles/tiny-llama-b0.5.yaml")
    assert default_out_path("m/SmolLM2.Q4.gguf", 0.25) == Path("profiles/SmolLM2.Q4-b0.25.yaml")


def test_reference_tokens_default_is_the_library_default() -> None:
    import inspect

    from kvtool.calibration.config import REFERENCE_TOKENS
    from kvtool.cli.calibrate import calibrate_command

    assert inspect.signature(calibrate_command).parameters["reference_tokens"].default == REFERENCE_TOKENS


def test_samples_default_is_the_library_default() -> None:
    import inspect

    from kvtool.calibration.config import DEFAULT_SAMPLES, HYBRID_SAMPLES, CalibrateConfig
    from kvtool.cli.calibrate import calibrate_command

    # None: the library picks by model (a hybrid model's calibration runs on fewer, longer prompts).
    assert inspect.signature(calibrate_command).parameters["samples"].default is None is CalibrateConfig().samples
    assert (DEFAULT_SAMPLES, HYBRID_SAMPLES) == (12, 10)


def test_budget_tokens_default_is_the_library_default() -> None:
    import inspect

    from kvtool.calibration.config import DEFAULT_BUDGET_TOKENS
    from kvtool.cli.calibrate import calibrate_command
    from kvtool.profiles.whole_cache import DEFAULT_BUDGET_TOKENS as PROFILE_DEFAULT

    assert inspect.signature(calibrate_command).parameters["budget_tokens"].default == DEFAULT_BUDGET_TOKENS == PROFILE_DEFAULT


def test_kv_formats_default_is_the_library_default_and_reaches_the_profile(
    calibrated: Path, tiny_llama_dir: Path, data_file: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """`--kv-formats` defaults to int8: the recipe, searched at the entries int8 keeps at the budget's
    bytes, is measured at int8 and at the model's own precision, both at those bytes, and the profile
    records both trials; `per-layer` asks each layer to choose, which needs
    the layers' measured losses (a one-line error without them)."""
    import inspect

    from kvtool.calibration.config import DEFAULT_KV_FORMATS
    from kvtool.calibration.storage import NATIVE_NAME
    from kvtool.cli.calibrate import KV_FORMATS_DEFAULT, calibrate_command

    assert inspect.signature(calibrate_command).parameters["kv_formats"].default == KV_FORMATS_DEFAULT
    assert tuple(KV_FORMATS_DEFAULT.split(",")) == DEFAULT_KV_FORMATS
    trials = read_profile(calibrated).calibration.storages
    assert [t.storage for t in trials] == [NATIVE_NAME, "int8"] and sum(bool(t.shipped) for t in trials) == 1
    out = tmp_path / "q.yaml"
    code, _, err = run(monkeypatch, capsys, "calibrate", str(tiny_llama_dir), "--budget", "0.5", "--samples", "2",
                       "--data", str(data_file), "--papers", "--kv-formats", "int8,per-layer", "--out", str(out))
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "measured loss" in errors[0] and "Traceback" not in err and not out.exists()


def test_calibrate_help_lists_at_most_fifteen_options() -> None:
    """The options a user reads in `kvtool calibrate --help` (help itself aside): the draft is one
    option, and what was measured as no better (lookahead, reused drafts, in-context answer
    references) is gone. The thirteenth is hybrid models' `--budget-tokens` (what a budget means
    there), the fourteenth the storages a layer may choose (`--kv-formats`), the fifteenth the
    serving engine whose recipe is measured beside kvtool's (`--engine`)."""
    import typer

    from kvtool.cli.app import _register, app

    _register()
    command = typer.main.get_command(app).commands["calibrate"]
    options = [p.opts[0] for p in command.params if p.param_type_name == "option" and p.name != "help"]
    assert len(options) <= 15, options
    assert not any(name.startswith(("--lookahead", "--draft-", "--answer-references")) for name in options)


def test_malformed_data_line_is_named(tiny_llama_dir: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "the cat sat"}\n{"prompt": oops}\n', encoding="utf-8")
    code, _, stderr = run(
        monkeypatch, capsys, "calibrate", str(tiny_llama_dir), "--budget", "0.3", "--data", str(bad),
        "--out", str(tmp_path / "p.yaml"),
    )
    assert code == 2 and "bad.jsonl line 2: not valid JSON" in stderr and len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "p.yaml").exists()


def test_inspect_gini_json_contract(calibrated: Path, monkeypatch, capsys) -> None:
    code, stdout, stderr = run(monkeypatch, capsys, "inspect", "gini", str(calibrated), "--json")
    assert code == 0, stderr
    doc = json.loads(stdout)
    profile = read_profile(calibrated)
    assert list(doc) == ["budget", "p", "truncation_distance", "budget_tokens", "ratios", "scorer", "prefixkv_p",
                         "corr_gini_ratio", "corr_gini_prefixkv", "layers"]
    assert doc["budget"] == 0.3 and doc["p"] == profile.calibration.retention_p
    assert doc["truncation_distance"] == profile.method.truncation_distance and doc["ratios"] == profile.method.ratios
    keys = ["layer", "ratio", "gini", "ratio_std", "loss", "kind", "source", "window", "prefixkv_ratio"]
    assert [list(layer) for layer in doc["layers"]] == [keys] * len(profile.layers)
    assert [layer["layer"] for layer in doc["layers"]] == list(range(len(profile.layers)))
    assert [layer["ratio"] for layer in doc["layers"]] == profile.ratios
    # The budget is bytes: 0.3 of them at the storage calibration shipped (the default measures int8).
    from kvtool.profiles.byte_budget import byte_share
    from kvtool.profiles.entry_bytes import entry_share

    layer = profile.layers[0]
    entries = min(1.0, 0.3 / entry_share(layer.keys_format, layer.values_format, profile.model.head_dim, profile.native_bytes or 4))
    assert byte_share(profile) == pytest.approx(0.3, abs=1e-9)
    assert np.mean([layer["ratio"] for layer in doc["layers"]]) == pytest.approx(entries, abs=1e-9)
    assert np.mean([layer["prefixkv_ratio"] for layer in doc["layers"]]) == pytest.approx(entries, abs=1e-9)


def test_inspect_gini_table(calibrated: Path, monkeypatch, capsys) -> None:
    code, stdout, _ = run(monkeypatch, capsys, "inspect", "gini", str(calibrated))
    assert code == 0
    for heading in ("Gini", "PrefixKV", "Shipped", "Source", "Loss"):
        assert heading in stdout
    assert "retention p" in stdout and "corr(Gini, shipped ratio)" in stdout and "corr(Gini, PrefixKV ratio)" in stdout


def test_inspect_gini_on_a_model_computes_curves(tiny_llama_dir: Path, data_file: Path, monkeypatch, capsys) -> None:
    code, stdout, stderr = run(
        monkeypatch, capsys, "inspect", "gini", str(tiny_llama_dir), "--data", str(data_file), "--samples", "2",
        "--budget", "0.4", "--json",
    )
    assert code == 0, stderr
    doc = json.loads(stdout)
    assert doc["budget"] == 0.4 and all(layer["gini"] is not None for layer in doc["layers"])
    assert np.mean([layer["prefixkv_ratio"] for layer in doc["layers"]]) == pytest.approx(0.4, abs=1e-12)
    # Measured now there is no shipped profile: the table shows PrefixKV's ratios and their spread.
    code, stdout, stderr = run(
        monkeypatch, capsys, "inspect", "gini", str(tiny_llama_dir), "--data", str(data_file), "--samples", "2",
        "--budget", "0.4",
    )
    assert code == 0, stderr
    assert "PrefixKV" in stdout and "Spread" in stdout and "Shipped" not in stdout and "corr(Gini, PrefixKV ratio)" in stdout


def test_inspect_gini_plot(calibrated: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    png = tmp_path / "gini.png"
    code, _, stderr = run(monkeypatch, capsys, "inspect", "gini", str(calibrated), "--plot", str(png))
    if HAS_MATPLOTLIB:
        assert code == 0, stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert code == 2 and not png.exists()
        assert stderr.startswith("error: --plot needs matplotlib") and "kvtool[plot]" in stderr
        assert len(stderr.strip().splitlines()) == 1


def test_inspect_gini_missing_profile(tmp_path: Path, monkeypatch, capsys) -> None:
    code, _, stderr = run(monkeypatch, capsys, "inspect", "gini", str(tmp_path / "none.yaml"))
    assert code == 2 and "no such profile file" in stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (("nosuch",), "No such command 'nosuch'"),
        (("inspect", "recipe", "x.yaml"), "No such command 'recipe'"),
        (("calibrate", "smollm2", "--nosuch"), "No such option: --nosuch"),
        (("calibrate", "smollm2", "--budget", "lots"), "Invalid value for '--budget'"),
    ],
)
def test_usage_errors_are_messages_not_tracebacks(args, message, monkeypatch, capsys) -> None:
    code, _, stderr = run(monkeypatch, capsys, *args)
    assert code == 2 and message in stderr
    assert "Traceback" not in stderr


# --------------------------------------------------------------------------- the real model


@pytest.mark.slow
def test_smollm2_ratios_agree_across_disjoint_sample_sets(smollm2: str) -> None:
    """PrefixKV's offline-estimation claim on the real model: two disjoint prompt sets, same ratios.

    The shipped set interleaves its five kinds (document, image, chat, code, retrieval), so rows 0-4
    and 5-9 are two disjoint sets with the same mix. Small on purpose (5 prompts each, cut to 256
    tokens, no truncation search): the ratios only need the prompt forward. Measured: mean |diff|
    0.012, max |diff| 0.042 over the 30 layers.
    """
    from kvtool.models import load_model

    model = load_model(smollm2)
    records = load_jsonl()
    first, second = records[0:5], records[5:10]
    assert not {r.prompt for r in first} & {r.prompt for r in second}
    ratios = [
        np.array(calibrate(model, 0.2, data=part, samples=5, max_prompt_tokens=256, candidates=(), draft=None).profile.ratios)  # the draft does not change the ratios
        for part in (first, second)
    ]
    diff = np.abs(ratios[0] - ratios[1])
    print(f"smollm2 disjoint sets: mean |diff| {diff.mean():.4f}, max |diff| {diff.max():.4f}")
    assert diff.mean() < 0.03 and diff.max() < 0.1
    assert np.corrcoef(ratios[0], ratios[1])[0, 1] > 0.9


def test_draft_default_is_the_library_default_and_reaches_the_profile(
    tiny_llama_dir: Path, data_file: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    import inspect

    from kvtool.calibration.config import DEFAULT_DRAFT
    from kvtool.cli.calibrate import calibrate_command, parse_draft
    from kvtool.profiles import Draft

    assert parse_draft(inspect.signature(calibrate_command).parameters["draft"].default) == (DEFAULT_DRAFT, False)
    from kvtool.calibration.config import DEFAULT_MAX_PROMPT_OVERHEAD
    from kvtool.cli.calibrate import parse_overhead

    limit = inspect.signature(calibrate_command).parameters["max_prompt_overhead"].default
    assert parse_overhead(limit) == DEFAULT_MAX_PROMPT_OVERHEAD and parse_overhead("none") is None
    assert parse_draft("32") == (Draft(32, DEFAULT_DRAFT.rounds, DEFAULT_DRAFT.verify, DEFAULT_DRAFT.jacobi), False)  # the rest as the default
    assert parse_draft("8,rounds=1,no-verify,no-jacobi,stage") == (Draft(8), True)
    assert parse_draft("8,jacobi") == (Draft(8, DEFAULT_DRAFT.rounds, DEFAULT_DRAFT.verify, jacobi=True), False)
    assert parse_draft("none") == (None, False) and parse_draft("0") == (None, False)
    out = tmp_path / "p.yaml"
    code, _, err = run(monkeypatch, capsys, "calibrate", str(tiny_llama_dir), "--budget", "0.5", "--samples", "2",
                       "--data", str(data_file), "--papers", "--draft", "6,rounds=3", "--max-prompt-overhead", "none", "--out", str(out))
    assert code == 0, err
    assert read_profile(out).method.draft == Draft(6, 3, verify=True)
    code, shown, _ = run(monkeypatch, capsys, "inspect", "profile", str(out))
    assert code == 0 and "prompt compressed with the attention of a 6-token draft (3 rounds, verified)" in " ".join(shown.split())
    overhead = read_profile(out).calibration.prompt_overhead
    text = " ".join(shown.split())
    assert overhead > 0 and f"{overhead:.2f}x the full cache's" in text and "(no limit)" in text
    code, _, err = run(monkeypatch, capsys, "calibrate", str(tiny_llama_dir), "--budget", "0.5", "--samples", "2",
                       "--data", str(data_file), "--papers", "--draft", "6,no-verify", "--max-prompt-overhead", "none", "--out", str(out))
    assert code == 0, err
    assert read_profile(out).method.draft == Draft(6, DEFAULT_DRAFT.rounds, verify=False)
    code, _, err = run(monkeypatch, capsys, "calibrate", str(tiny_llama_dir), "--budget", "0.5", "--samples", "2",
                       "--data", str(data_file), "--papers", "--draft", "none", "--out", str(out))
    assert code == 0, err
    assert read_profile(out).method.draft is None and "draft" not in out.read_text().split("calibration:")[0]
    for bad, says in (
        (["--draft", "-2"], "--draft takes TOKENS"),
        (["--draft", "6,rounds=0"], "--draft rounds must be at least 1"),
        (["--draft", "6,reuse"], "--draft takes TOKENS"),
        (["--lookahead", "2"], "No such option"),
        (["--max-prompt-overhead", "0.5"], "--max-prompt-overhead takes a number >= 1"),
        (["--max-prompt-overhead", "fast"], "--max-prompt-overhead takes a number >= 1"),
    ):
        code, _, err = run(monkeypatch, capsys, "calibrate", str(tiny_llama_dir), "--budget", "0.5", *bad,
                           "--out", str(tmp_path / "q.yaml"))
        assert code == 2 and says in err and "Traceback" not in err and not (tmp_path / "q.yaml").exists()


def test_calibrate_with_measured_ratios_says_where_they_came_from(
    tiny_llama_dir: Path, data_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    out = tmp_path / "measured.yaml"
    code, stdout, stderr = run(
        monkeypatch, capsys, "calibrate", str(tiny_llama_dir), "--budget", "0.3", "--samples", "3",
        "--data", str(data_file), "--out", str(out), "--space", "ratio_sources=measured",
    )
    assert code == 0, stderr
    profile = read_profile(out)
    assert profile.method.ratios == "measured" and all(layer.loss_curve for layer in profile.layers)
    assert "measured loss on" in stdout and "Retention p" not in stdout and "nan" not in stdout
    assert "layer loss" in stderr  # its progress bar
