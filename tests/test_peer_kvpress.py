"""benchmarks/peer_kvpress.py without kvpress: its scoring, JSON, argument checks and protocol
pieces (compared with kvtool's own), plus an end-to-end run of its no-press row on the tiny Llama.

The script lives in its own virtual environment (kvpress pins an older transformers); it imports
torch, transformers and kvpress lazily, so its helpers load here by path.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "peer_kvpress.py"


def _load():
    spec = importlib.util.spec_from_file_location("peer_kvpress", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


peer = _load()


def test_import_pulls_in_neither_torch_nor_kvpress():
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('peer', {str(SCRIPT)!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['peer'] = m; spec.loader.exec_module(m)\n"
        "print(sorted(n for n in ('torch', 'transformers', 'kvpress', 'rouge_score') if n in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------------------------------ scoring


def test_accuracy_is_the_share_of_answers_found_ignoring_case():
    assert peer.answer_accuracy("The numbers are 4831967 and 12.", ["4831967", "555"]) == 0.5
    assert peer.answer_accuracy("KEY: Alpha-7", ["alpha-7"]) == 1.0
    assert peer.answer_accuracy("nothing here", ["4831967"]) == 0.0


@pytest.mark.parametrize(
    "prediction, target",
    [("the cat sat on the mat", "the cat sat"), ("", ""), ("", "something"), ("a b c d", "d c b a"), ("x", "y")],
)
def test_rouge_l_is_kvtools(prediction, target):
    from kvtool.evaluation.metrics import rouge_l_f1

    assert peer.rouge_l_f1(prediction, target) == rouge_l_f1(prediction, target)


def _score(nll, tokens, rouge, accuracy=None, kept=0, full=0, physical=None):
    return peer.PromptScore(nll, tokens, "out", rouge, accuracy, kept, kept if physical is None else physical, full)


def test_result_pools_ppl_over_tokens_and_keeps_per_prompt_values():
    rows = [peer.Row("a", "doc"), peer.Row("b", "retrieval", ("42",)), peer.Row("c", "retrieval", ("7", "8"))]
    scores = [
        _score(10.0, 10, 0.5, None, kept=20, full=100),
        _score(1.0, 2, 1.0, 1.0, kept=30, full=100, physical=100),
        _score(3.0, 4, 0.0, 0.5, kept=50, full=200),
    ]
    result = peer.summarize(peer.PRESSES["tova"], 0.2, scores, rows, seconds=6.0)

    assert result["method"] == "kvpress:tova" and result["press"] == "TOVAPress" and result["prompt_only"] is True
    assert result["budget"] == 0.2 and result["compression_ratio"] == pytest.approx(0.8)
    assert result["ppl"] == pytest.approx(math.exp(14.0 / 16))  # pooled, not a mean of per-prompt PPLs
    assert result["tokens"] == 16
    assert result["rouge_l"] == pytest.approx(0.5)
    assert result["rouge_l_per_prompt"] == [0.5, 1.0, 0.0]
    assert result["rouge_l_sem"] == pytest.approx(0.5 / math.sqrt(3))
    assert result["accuracy"] == pytest.approx(0.75)  # answer rows only
    assert result["accuracy_per_prompt"] == [None, 1.0, 0.5]
    assert result["kv_fraction"] == pytest.approx(100 / 400)
    assert result["kv_fraction_physical"] == pytest.approx(170 / 400)
    assert result["seconds_per_prompt"] == pytest.approx(2.0)
    assert result["kinds"]["doc"] == {"ppl": pytest.approx(math.exp(1.0)), "rouge_l": 0.5, "rouge_l_sem": None, "accuracy": None, "samples": 1}
    retrieval = result["kinds"]["retrieval"]
    assert retrieval["ppl"] == pytest.approx(math.exp(4.0 / 6)) and retrieval["accuracy"] == pytest.approx(0.75)
    assert retrieval["samples"] == 2
    json.dumps(result, allow_nan=False)  # NaN-free: a standard JSON reader takes it


def test_result_without_answers_or_kinds_has_null_accuracy_and_no_kinds():
    rows = [peer.Row("a"), peer.Row("b")]
    result = peer.summarize(peer.PRESSES["tova_decoding"], 0.5, [_score(1.0, 1, 1.0), _score(1.0, 1, 0.0)], rows, 1.0)
    assert result["accuracy"] is None and result["accuracy_per_prompt"] == [None, None]
    assert result["kinds"] == {} and result["prompt_only"] is False
    assert result["kv_fraction"] is None  # nothing measured: null, not NaN
    json.dumps(result, allow_nan=False)


def test_full_cache_summary():
    rows = [peer.Row("a", "x"), peer.Row("b", "x", ("1",))]
    full = peer.summarize_full([_score(2.0, 2, None), _score(0.0, 2, None, 1.0)], rows)
    assert full["full_ppl"] == pytest.approx(math.exp(0.5)) and full["reference_tokens"] == 4
    assert full["full_accuracy"] == 1.0 and full["full_accuracy_per_prompt"] == [None, 1.0]
    assert full["full_kinds"] == {"x": {"ppl": pytest.approx(math.exp(0.5)), "accuracy": 1.0, "samples": 2}}


# ------------------------------------------------------------------------------------------ presses


class _Recorder:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


def _fake_kvpress():
    names = (
        "TOVAPress", "SnapKVPress", "StreamingLLMPress", "ExpectedAttentionPress", "AdaKVPress", "KnormPress",
        "PrefillDecodingPress", "CompressionRatioDecodingPress",
    )
    return types.SimpleNamespace(**{name: type(name, (_Recorder,), {}) for name in names})


def test_budget_is_turned_into_kvpress_compression_ratio():
    kv = _fake_kvpress()
    ratio = peer.compression_ratio(0.2)
    assert ratio == pytest.approx(0.8)
    tova = peer.PRESSES["tova"].build(kv, ratio)
    assert type(tova).__name__ == "TOVAPress" and tova.kwargs == {"compression_ratio": ratio}
    ada = peer.PRESSES["adakv_expected_attention"].build(kv, ratio)
    assert type(ada).__name__ == "AdaKVPress" and ada.args[0].kwargs == {"compression_ratio": ratio}
    assert peer.PRESSES["none"].build(kv, ratio) is None


def test_decoding_press_holds_the_budget_every_step():
    held = peer.PRESSES["tova_decoding"].build(_fake_kvpress(), 0.9)
    assert type(held).__name__ == "PrefillDecodingPress"
    assert held.kwargs["prefilling_press"].kwargs == {"compression_ratio": 0.9}
    decoding = held.kwargs["decoding_press"]
    assert type(decoding).__name__ == "CompressionRatioDecodingPress"
    assert decoding.kwargs["target_compression_ratio"] == 0.9 and decoding.kwargs["compression_interval"] == 1
    assert type(decoding.kwargs["base_press"]).__name__ == "TOVAPress"
    assert all(spec.prompt_only == (not name.endswith("_decoding")) for name, spec in peer.PRESSES.items())


def test_snapkv_refuses_prompts_within_its_window_up_front():
    with pytest.raises(peer.PeerError, match="prompt 2 is 64 tokens"):
        peer._check_press_fits(["tova", "snapkv"], [[0] * 65, [0] * 64])
    peer._check_press_fits(["tova"], [[0] * 10])


# ------------------------------------------------------------------------------------------ arguments and files


@pytest.fixture()
def model_dir(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return tmp_path / "model"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--presses", "tova,h2o"], "unknown press 'h2o'"),
        (["--presses", " , "], "--presses is empty"),
        (["--budgets", "0"], "kept fraction in (0, 1]"),
        (["--budgets", "1.5"], "kept fraction in (0, 1]"),
        (["--budgets", "nan"], "kept fraction in (0, 1]"),
        (["--budgets", "a"], "budget must be a number"),
        (["--limit", "0"], "--limit must be at least 1"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        (["--threads", "0"], "--threads must be at least 1"),
        (["--kinds", " , "], "--kinds is empty"),
        (["--quantized-cache", "3"], "invalid choice: 3"),
        (["--residual-length", "0"], "--residual-length must be at least 1"),
        (["--bogus"], "unrecognized arguments"),
    ],
)
def test_bad_arguments(model_dir, extra, message):
    with pytest.raises(peer.PeerError, match=message.replace("(", r"\(").replace(")", r"\)")):
        peer.parse_args(["--model-dir", str(model_dir), *extra])


def test_arguments_parse(model_dir):
    options = peer.parse_args(["--model-dir", str(model_dir), "--presses", "knorm,tova,knorm", "--budgets", "0.5,0.1"])
    assert options.presses == ("knorm", "tova") and options.budgets == (0.5, 0.1)
    assert options.max_new_tokens == 64 and options.max_prompt_tokens == 2048 and options.data == peer.DEFAULT_DATA
    assert options.kinds is None
    assert peer.parse_args(["--model-dir", str(model_dir), "--kinds", "code, chat,code"]).kinds == ("code", "chat")
    assert options.quantized is None
    quantized = peer.parse_args(["--model-dir", str(model_dir), "--quantized-cache", "4", "--residual-length", "32"]).quantized
    assert quantized == peer.Quantized(bits=4, residual=32, group=64)
    assert quantized.name == "quanto int4 g64 residual 32"


def test_quantized_bytes_count_codes_scales_and_zero_points():
    """A quanto tensor's bytes are its packed codes', scales' and zero points' (the layout of one
    quantized at 4 bits in groups of 64: 300 vectors of 64 values), plus the layer's full-precision
    residual; a plain tensor's are its own."""
    import torch

    packed = types.SimpleNamespace(_data=torch.zeros(150, 64, dtype=torch.uint8))
    quantized = types.SimpleNamespace(_data=packed, _scale=torch.zeros(300, 1), _shift=torch.zeros(300, 1))
    assert peer.tensor_bytes(quantized) == 150 * 64 + 2 * 300 * 4
    assert peer.tensor_bytes(torch.zeros(2, 3, dtype=torch.float16)) == 12
    assert peer.tensor_bytes(quantized, as_16bit=True) == 150 * 64 + 2 * 300 * 2  # scales and zeros at 16 bits
    residual = torch.zeros(1, 3, 5, 64)
    layer = types.SimpleNamespace(keys=residual, values=residual, _quantized_keys=quantized, _quantized_values=quantized)
    assert peer.kv_bytes(types.SimpleNamespace(layers=[layer, layer])) == 2 * (2 * residual.numel() * 4 + 2 * peer.tensor_bytes(quantized))


def test_a_quantized_result_reports_a_share_of_bytes():
    rows = [peer.Row("a", "doc"), peer.Row("b", "doc")]
    scores = [
        peer.PromptScore(1.0, 1, "o", 1.0, None, 50, 50, 100, kv_bytes=1000, kv_full_bytes=8000, kv_bytes_16bit=600),
        peer.PromptScore(1.0, 1, "o", 1.0, None, 100, 100, 100, kv_bytes=3000, kv_full_bytes=8000, kv_bytes_16bit=1400),
    ]
    plain = peer.summarize(peer.PRESSES["tova"], 0.5, scores, rows, 1.0)
    assert plain["kv_fraction"] == pytest.approx(0.75) and "kv_fraction_16bit" not in plain
    result = peer.summarize(peer.PRESSES["tova"], 0.5, scores, rows, 1.0, peer.Quantized(4), element_bytes=4)
    assert result["kv_fraction"] == pytest.approx(4000 / 16000)  # bytes held over a float32 full cache's
    assert result["kv_fraction_16bit"] == pytest.approx(2000 / 8000)  # as a 16-bit model holds them, over its full cache
    assert result["kv_fraction_entries"] == pytest.approx(0.75)
    assert result["kv_format"] == "quanto int4 g64 residual 128"


def test_main_reports_one_line_and_exit_2(tmp_path, model_dir, capsys):
    assert peer.main(["--model-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: --model-dir {tmp_path}: not a Hugging Face model directory (no config.json)"]
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "fine"}\n{"prompt": "x", "answers": "42"}\n')
    # The data file is checked before the (slow) model load, which this model dir would fail.
    assert peer.main(["--model-dir", str(model_dir), "--data", str(data)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {data} line 2: \"answers\" must be a non-empty list of non-empty strings"]


def test_rows(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": " a\\r\\nb ", "kind": "chat"}\n\n{"prompt": "c", "answers": ["1", "2"]}\n{"prompt": "d"}\n')
    rows = peer.load_rows(data)
    assert rows == [peer.Row("a\nb", "chat"), peer.Row("c", None, ("1", "2")), peer.Row("d")]
    assert peer.load_rows(data, limit=2) == rows[:2]
    assert peer.load_rows(data, kinds=("chat",)) == rows[:1]
    with pytest.raises(peer.PeerError, match="no prompts of kind 'code' \\(its kinds: chat\\)"):
        peer.load_rows(data, kinds=("chat", "code"))
    for bad, message in [('{"kind": "x"}', "\"prompt\" must be"), ('{"prompt": "a", "kind": 3}', "\"kind\""), ("[1]", "JSON object")]:
        data.write_text(bad + "\n")
        with pytest.raises(peer.PeerError, match=message):
            peer.load_rows(data)
    with pytest.raises(peer.PeerError, match="no such data file"):
        peer.load_rows(tmp_path / "missing.jsonl")


def test_references(tmp_path):
    path = tmp_path / "eval.json"
    outputs = [{"text": "one", "token_ids": [5, 2]}, {"text": "two", "token_ids": [7]}, {"text": "x", "token_ids": [1]}]
    path.write_text(json.dumps({"full_ppl": 2.0, "full_outputs": outputs}))
    assert peer.load_references(path, 2) == [peer.Reference("one", (5, 2)), peer.Reference("two", (7,))]
    with pytest.raises(peer.PeerError, match="has 3 full outputs for 4 prompts"):
        peer.load_references(path, 4)
    path.write_text(json.dumps({"results": []}))
    with pytest.raises(peer.PeerError, match="no \"full_outputs\" list"):
        peer.load_references(path, 1)
    path.write_text(json.dumps({"full_outputs": [{"text": "a", "token_ids": []}]}))
    with pytest.raises(peer.PeerError, match=r"full_outputs\[0\] must be"):
        peer.load_references(path, 1)


# ------------------------------------------------------------------------------------------ protocol parity with kvtool


CHAT_TEMPLATE = "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}{% if add_generation_prompt %}<s> assistant :{% endif %}"
LONG_PROMPT = " ".join(["once upon a time there was a cat and it sat on the mat"] * 12)


def test_prompt_encoding_is_kvtools(word_tokenizer):
    from kvtool.scoring.encoding import encode_prompt

    tokenizer = word_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    for prompt, limit in [("tell me a story", 1024), (LONG_PROMPT, 40), (LONG_PROMPT, 1024)]:
        ours = peer.encode_prompt(tokenizer, prompt, limit)
        assert ours == encode_prompt(tokenizer, prompt, limit)
        assert len(ours) <= limit
    assert len(peer.encode_prompt(tokenizer, LONG_PROMPT, 40)) < len(peer.encode_prompt(tokenizer, LONG_PROMPT, 1024))


def test_no_press_row_reproduces_the_full_cache(tiny_llama_dir, tmp_path):
    """The press-free path through the script's own prefill / teacher forcing / greedy loop must give
    back the full cache exactly (PPL equal, ROUGE-L 1), and --references must be taken as given."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    data = tmp_path / "d.jsonl"
    data.write_text(
        json.dumps({"prompt": "tell me a story about the cat", "kind": "story"}) + "\n"
        + json.dumps({"prompt": "who sat on the mat ? the dog", "kind": "qa", "answers": ["dog", "CAT"]}) + "\n"
    )
    out = tmp_path / "r.json"
    args = ["--model-dir", str(model), "--data", str(data), "--presses", "none", "--budgets", "0.2", "--max-new-tokens", "6"]
    assert peer.main([*args, "--json", str(out), "--threads", "1"]) == 0
    doc = json.loads(out.read_text())

    assert doc["tool"] == "kvpress" and doc["samples"] == 2 and doc["max_new_tokens"] == 6
    assert all(1 <= len(o["token_ids"]) <= 6 for o in doc["full_outputs"])
    assert doc["reference_tokens"] == sum(len(o["token_ids"]) for o in doc["full_outputs"])
    [row] = doc["results"]
    assert row["method"] == "kvpress:none" and row["budget"] == 1.0
    assert row["ppl"] == pytest.approx(doc["full_ppl"], rel=1e-9)
    assert row["rouge_l_per_prompt"] == [1.0, 1.0] and row["kv_fraction"] == 1.0
    assert row["accuracy_per_prompt"][0] is None and row["accuracy_per_prompt"][1] == doc["full_accuracy_per_prompt"][1]
    assert set(row["kinds"]) == {"story", "qa"}

    # Given references replace the computed ones: here the second row's reference is shifted, so
    # its full-cache NLL (and PPL) changes while the first row's text becomes the ROUGE-L target.
    given = json.loads(out.read_text())
    given["full_outputs"][0]["text"] = "something else entirely"
    given["full_outputs"][1]["token_ids"] = given["full_outputs"][1]["token_ids"][::-1] + [3]
    references = tmp_path / "kvtool-eval.json"
    references.write_text(json.dumps(given))
    out2 = tmp_path / "r2.json"
    assert peer.main([*args, "--json", str(out2), "--references", str(references)]) == 0
    doc2 = json.loads(out2.read_text())
    assert doc2["full_outputs"] == given["full_outputs"]
    assert doc2["reference_tokens"] == doc["reference_tokens"] + 1
    assert doc2["full_ppl"] != pytest.approx(doc["full_ppl"])
    [row2] = doc2["results"]
    assert row2["ppl"] == pytest.approx(doc2["full_ppl"], rel=1e-9)
    assert row2["rouge_l_per_prompt"][0] < 1.0 and row2["rouge_l_per_prompt"][1] == 1.0


def test_full_entries_count_sliding_layers_as_stored():
    config = types.SimpleNamespace(
        num_hidden_layers=4, num_key_value_heads=2, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    )
    assert peer.full_entries(config, 5) == 2 * 4 * 5  # inside the window every layer holds all
    assert peer.full_entries(config, 100) == 2 * (3 * 7 + 100)  # sliding layers keep window - 1
    plain = types.SimpleNamespace(num_hidden_layers=3, num_key_value_heads=1, sliding_window=None, layer_types=None)
    assert peer.full_entries(plain, 50) == 150
    assert peer.is_hybrid(config) and not peer.is_hybrid(plain)


def test_sliding_layers_are_left_whole():
    class Press:
        def __init__(self):
            self.seen = []

        def forward_hook(self, module, input, kwargs, output):
            self.seen.append(module.name)
            return "compressed"

    press = peer.skip_sliding_layers(Press())
    sliding = types.SimpleNamespace(name="local", is_sliding=True)
    full = types.SimpleNamespace(name="global", is_sliding=False)
    assert press.forward_hook(sliding, (), {}, "out") == "out"
    assert press.forward_hook(full, (), {}, "out") == "compressed"
    assert press.seen == ["global"] and peer.skip_sliding_layers(None) is None


def test_gemma_turns_without_a_template_are_kvtools(word_tokenizer):
    from kvtool.models.prompts import format_prompts

    tokenizer = word_tokenizer()
    tokenizer.chat_template = None
    tokenizer.add_tokens(["<start_of_turn>", "<end_of_turn>"], special_tokens=True)
    [text] = format_prompts(tokenizer, ["tell me a story"])
    assert peer.encode_prompt(tokenizer, "tell me a story", 1024) == tokenizer(text, add_special_tokens=False)["input_ids"]
