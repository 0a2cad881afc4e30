"""`kvtool generate --budget/--profile`: the compressing cache through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtool.models import load_model
from kvtool.profiles import save_profile
from kvtool.runtime import uniform_profile
from test_cli_generate import run_cli

WORDS = "the cat sat on the mat and it ran away to the big red house in the sun".split()
PROMPTS = [" ".join(WORDS * 4), " ".join(WORDS[3:] * 2)]


def generate_json(model_dir: Path, *extra: str) -> dict:
    done = run_cli("generate", str(model_dir), *PROMPTS, "--max-new-tokens", "12", "--json", *extra)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_budget_one_generates_what_the_full_cache_generates(tiny_llama_dir: Path) -> None:
    full = generate_json(tiny_llama_dir)
    same = generate_json(tiny_llama_dir, "--budget", "1.0")
    assert same["outputs"] == full["outputs"]
    assert "every entry kept" in same["cache"] and "full" in full["cache"]


def test_budget_shrinks_the_reported_cache(tiny_llama_dir: Path) -> None:
    full = generate_json(tiny_llama_dir)
    small = generate_json(tiny_llama_dir, "--budget", "0.25")
    assert small["kv_bytes_full"] == full["kv_bytes_full"]
    assert small["kv_bytes"] < 0.6 * full["kv_bytes"]


def test_min_kept_floor_through_the_cli(tiny_llama_dir: Path) -> None:
    full = generate_json(tiny_llama_dir)
    small = generate_json(tiny_llama_dir, "--budget", "0.25")
    whole = generate_json(tiny_llama_dir, "--budget", "0.25", "--min-kept", "1000")
    some = generate_json(tiny_llama_dir, "--budget", "0.25", "--min-kept", "40")
    # A floor above every sequence keeps it whole: the full cache's text (the kvtool cache's bytes
    # also count its slot bookkeeping and growth slots). The budget's own text may equal it too: its
    # verified draft can be the full cache's whole answer when the answer is this short.
    assert whole["outputs"] == full["outputs"]
    assert "at least 1000 entries per layer" in whole["cache"]
    assert small["kv_bytes"] < some["kv_bytes"] < whole["kv_bytes"]
    done = run_cli("generate", str(tiny_llama_dir), "hi", "--min-kept", "-1")
    assert done.returncode == 2 and "'--min-kept'" in done.stderr and "Traceback" not in done.stderr


def test_a_kv_format_stores_the_kept_entries_in_it(tiny_llama_dir: Path, tmp_path: Path) -> None:
    profile = uniform_profile(load_model(str(tiny_llama_dir)).model, 0.3)
    path = save_profile(profile, tmp_path / "tiny.yaml")
    native = generate_json(tiny_llama_dir, "--profile", str(path))
    int8 = generate_json(tiny_llama_dir, "--profile", str(path), "--kv-format", "int8")
    assert "entries stored as int8" in int8["cache"] and int8["kv_bytes_full"] == native["kv_bytes_full"]
    assert int8["kv_bytes"] < native["kv_bytes_full"]


def test_profile_file_is_used(tiny_llama_dir: Path, tmp_path: Path) -> None:
    profile = uniform_profile(load_model(str(tiny_llama_dir)).model, 0.3)
    path = save_profile(profile, tmp_path / "tiny.yaml")
    out = generate_json(tiny_llama_dir, "--profile", str(path))
    assert str(path) in out["cache"] and out["kv_bytes"] < out["kv_bytes_full"]


def test_profile_for_another_model_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import tiny_gemma3

    path = save_profile(uniform_profile(tiny_gemma3(), 0.3), tmp_path / "other.yaml")
    done = run_cli("generate", str(tiny_llama_dir), "hi", "--profile", str(path))
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.startswith("error: profile is for") and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--budget", "0"], "error: budget must be a kept fraction in (0, 1]"),
        (["--budget", "1.5"], "error: budget must be a kept fraction in (0, 1]"),
        (["--profile", "no/such/profile.yaml"], "error: profile file not found: no/such/profile.yaml"),
        (["--budget", "0.2", "--kv-format", "int3"], "error: --kv-format takes FORMAT or KEYS/VALUES"),
        (["--kv-format", "int8"], "error: --kv-format needs --budget or --profile"),
    ],
)
def test_bad_budget_or_profile_is_one_line(tiny_llama_dir: Path, args: list[str], message: str) -> None:
    done = run_cli("generate", str(tiny_llama_dir), "hi", *args)
    assert done.returncode != 0 and done.stdout == ""
    assert done.stderr.startswith(message) and len(done.stderr.strip().splitlines()) == 1
