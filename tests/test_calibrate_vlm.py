"""Calibration and evaluation with images: JSONL `images`, batches with pixel inputs, the kept image
share in profiles and `inspect gini`, `lookm` in `kvtool eval`, and bad input, end to end on a tiny
random LLaVA saved with a processor built offline."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtool.calibration.statistics import PromptImages, kept_image_share
from kvtool.calibration.truncation import compress_recorded_prompt
from kvtool.data import load_jsonl
from kvtool.errors import KvtoolError
from kvtool.profiles import read_profile
from kvtool.runtime import attach, method_profile, uniform_profile
from kvtool.scoring import Encoded, left_pad, model_positions, prompt_forward, reference_continuations
from tiny_vlms import BUILDERS, IMAGE_TOKEN, save_tiny_llava
from cli_runner import run

WORDS = "the cat dog sat on mat and it ran away to house big small red blue green one two three".split()
NEW = 6


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)




def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def write_png(path: Path, height: int, width: int, seed: int) -> Path:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, word_tokenizer) -> Path:
    """A tiny random LLaVA with its processor (tokenizer with <image>, CLIP image processor) on disk."""
    return save_tiny_llava(tmp_path_factory.mktemp("tiny-llava"), word_tokenizer(("<image>",), with_pad=True))


@pytest.fixture(scope="module")
def image_data(tmp_path_factory) -> Path:
    """Images of different sizes (the processor resizes and crops them all to 32 px), referenced
    relative to the data file; one prompt places its image, one has two images, one is text only."""
    root = tmp_path_factory.mktemp("image-data")
    (root / "img").mkdir()
    write_png(root / "img" / "a.png", 24, 40, seed=1)
    write_png(root / "img" / "b.png", 48, 32, seed=2)
    rng = random.Random(3)
    rows = [
        {"prompt": words(rng, 20), "images": ["img/a.png"]},
        {"prompt": f"{words(rng, 6)} <image> {words(rng, 30)}", "images": ["img/b.png"]},
        {"prompt": f"<image> {words(rng, 10)} <image> {words(rng, 12)}", "images": ["img/b.png", "img/a.png"]},
    ]
    return write_jsonl(root / "data.jsonl", rows)


# ----- data --------------------------------------------------------------------------------------


def test_images_are_resolved_against_the_data_file(image_data: Path) -> None:
    records = load_jsonl(image_data)
    root = image_data.parent.resolve()
    assert [r.images for r in records] == [
        (str(root / "img" / "a.png"),),
        (str(root / "img" / "b.png"),),
        (str(root / "img" / "b.png"), str(root / "img" / "a.png")),
    ]


@pytest.mark.parametrize(
    ("images", "fragment"),
    [
        ("a.png", '"images" must be a list of image paths (strings), got str'),
        (["a.png", 3], '"images" must be a list of image paths (strings), got a list with non-strings'),
        ([""], '"images" has an empty path'),
        (["missing.png"], "image missing.png does not exist"),
        (["."], "image . is not a file"),
    ],
    ids=["string", "non-string", "empty", "missing", "directory"],
)
def test_bad_images_field_names_the_line(tmp_path: Path, images, fragment) -> None:
    write_png(tmp_path / "a.png", 8, 8, seed=0)
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "the cat"}, {"prompt": "the dog", "images": images}])
    with pytest.raises(KvtoolError) as info:
        load_jsonl(path)
    message = str(info.value)
    assert message.startswith(f"{path} line 2: ") and fragment in message and "\n" not in message


def test_dataset_hash_covers_image_content_not_text_records(tmp_path: Path) -> None:
    from kvtool.data import Record, dataset_hash

    a, b = write_png(tmp_path / "a.png", 8, 8, seed=0), write_png(tmp_path / "b.png", 8, 8, seed=1)
    text = Record(prompt="the cat")
    assert dataset_hash([text]) == dataset_hash([Record(prompt="the cat", images=())])
    assert dataset_hash([Record("the cat", images=(str(a),))]) != dataset_hash([Record("the cat", images=(str(b),))])
    copy = tmp_path / "elsewhere.png"
    copy.write_bytes(a.read_bytes())
    assert dataset_hash([Record("the cat", images=(str(a),))]) == dataset_hash([Record("the cat", images=(str(copy),))])


LLAVA_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() }}: {% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<image>\n{% else %}{{ item['text'] }} {% endif %}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def test_images_go_where_the_prompt_says_else_first(word_tokenizer) -> None:
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from kvtool.models.images import format_image_prompt

    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        tokenizer=word_tokenizer(("<image>",), with_pad=True), patch_size=8,
        vision_feature_select_strategy="default", num_additional_image_tokens=1, chat_template=LLAVA_TEMPLATE,
    )
    placed, first = "look <image> at this and <image> that", "look at this"
    # The processor's chat template gets text and image parts in the prompt's order.
    assert format_image_prompt(processor, placed, 2, "x") == "USER: look <image>\nat this and <image>\nthat ASSISTANT:"
    assert format_image_prompt(processor, first, 2, "x") == "USER: <image>\n<image>\nlook at this ASSISTANT:"
    # Without one: LLaVA-1.5's plain turn, BOS included (the tokenizer adds it to plain text).
    processor.chat_template = None
    assert format_image_prompt(processor, placed, 2, "x") == "<s>USER: look <image> at this and <image> that ASSISTANT:"
    assert format_image_prompt(processor, first, 2, "x") == "<s>USER: <image><image>\nlook at this ASSISTANT:"


# ----- batches with pixel inputs -----------------------------------------------------------------


@pytest.mark.parametrize("name", list(BUILDERS))
def test_padded_image_batch_continues_like_generate(name: str) -> None:
    """Prompts with images encoded one by one, left-padded into one batch (pixel inputs in row order,
    per-token inputs padded, Qwen2-VL's mrope positions from the model): the greedy continuation the
    calibration and evaluation loops produce is exactly `generate`'s on the same padded batch."""
    vlm = BUILDERS[name]()
    model = vlm.model
    lengths = [27, 11, 19]
    items = []
    for i, n in enumerate(lengths):
        single = vlm.batch([n], seed=1 + i)
        extras = {k: v for k, v in single.items() if k not in ("input_ids", "attention_mask")}
        items.append(Encoded(single["input_ids"][0].tolist(), extras))
    batch = model_positions(model, left_pad(items, (0, 1, 2), pad_id=0))
    reference = vlm.batch(lengths)
    assert torch.equal(batch.input_ids, reference["input_ids"])
    from transformers import DynamicCache

    with torch.no_grad():
        want = model.generate(**reference, max_new_tokens=NEW, do_sample=False)[:, -NEW:]
        cache = DynamicCache(config=model.config)
        first = prompt_forward(model, batch, cache)
        got = reference_continuations(model, cache, first, batch, length=NEW, eos_ids=set(), pad_id=0,
                                      answers=[None] * len(lengths))
    assert torch.equal(got.tokens, want)


def test_kept_image_share_is_what_the_compressed_cache_keeps() -> None:
    """The share recorded in the profile comes from the selection rule on the recorded importance; it
    equals the kept image entries of the cache that `compress_recorded_prompt` builds (which carries
    the image mask, so `lookm`'s text prior sees it), and that cache equals a real compressed forward."""
    vlm = BUILDERS["llava"]()
    model = vlm.model
    inputs = vlm.batch([6, 40, 21])
    items = [Encoded(inputs["input_ids"][i][inputs["attention_mask"][i].bool()].tolist(),
                     {"pixel_values": inputs["pixel_values"][i : i + 1]}) for i in range(3)]
    batch = left_pad(items, (0, 1, 2), pad_id=0)
    with torch.no_grad():
        with attach(model, uniform_profile(model, 1.0)) as handle:
            full = handle.new_cache(record_importance=True)
            prompt_forward(model, batch, full)
        recorded = PromptImages.of(full)
        assert torch.equal(recorded.image, (batch.input_ids == IMAGE_TOKEN))
        for method in ("lookm", "elastic"):
            profile = method_profile(method, model, 0.4)
            with attach(model, profile) as handle:
                rebuilt = compress_recorded_prompt(handle.new_cache(), full, batch.attention_mask)
                real = handle.new_cache()
                prompt_forward(model, batch, real)
            shares = kept_image_share([recorded], {i: 0.4 for i in rebuilt.compressing_layers()}, profile.method)
            for index, layer in rebuilt.compressing_layers().items():
                twin = real.compressing_layers()[index]
                assert torch.equal(layer.order[layer.valid], twin.order[twin.valid])
                assert (layer.kept_image == twin.kept_image).all()
                assert shares[index] == pytest.approx(float(np.mean(layer.kept_image / layer.kept)))
            if method == "lookm":
                # Text first: the short prompt keeps all its text, the long one no image entry at all.
                for layer in rebuilt.compressing_layers().values():
                    assert layer.kept_image[1] == 0 and layer.kept_image[0] > 0
    assert kept_image_share([], {0: 0.5}, profile.method) is None


# ----- end to end through the CLI ---------------------------------------------------------------


def test_calibrate_inspect_and_eval_with_images(llava_dir, image_data, tmp_path, monkeypatch, capsys) -> None:
    from kvtool.models import load_model

    loaded = load_model(str(llava_dir))
    assert type(loaded.model).__name__ == "LlavaForConditionalGeneration"
    assert type(loaded.processor).__name__ == "LlavaProcessor" and loaded.tokenizer is loaded.processor.tokenizer
    assert loaded.tokenizer.padding_side == "left" and "vision-language" in loaded.source

    out = tmp_path / "llava.yaml"
    # At the model's own precision: the image shares are the calibrated ratios' (a storage re-derives them).
    code, stdout, stderr = run(monkeypatch, capsys, "calibrate", str(llava_dir), "--budget", "0.5", "--samples", "2",
                               "--data", str(image_data), "--kv-formats", "native", "--out", str(out))
    assert code == 0, stderr
    profile = read_profile(out)
    shares = [layer.image_share for layer in profile.layers]
    assert all(share is not None and 0.0 <= share <= 1.0 for share in shares)
    assert np.mean(profile.ratios) == pytest.approx(0.5, abs=1e-9)

    code, stdout, stderr = run(monkeypatch, capsys, "inspect", "gini", str(out), "--json")
    assert code == 0, stderr
    doc = json.loads(stdout)
    assert [layer["image_share"] for layer in doc["layers"]] == shares
    code, stdout, _ = run(monkeypatch, capsys, "inspect", "gini", str(out))
    assert code == 0 and "│ Image │" in stdout.replace("┃", "│")
    assert f"{shares[0]:.1%}" in stdout and "share of kept prompt entries that are image tokens" in stdout

    results = tmp_path / "eval.json"
    code, stdout, stderr = run(monkeypatch, capsys, "eval", str(llava_dir), "--data", str(image_data),
                               "--budgets", "0.5", "--methods", "elastic,lookm", "--max-new-tokens", "3",
                               "--json", str(results))
    assert code == 0, stderr
    doc = json.loads(results.read_text())
    assert [(r["method"], r["budget"]) for r in doc["results"]] == [("elastic", 0.5), ("lookm", 0.5)]
    assert doc["samples"] == 3 and all(np.isfinite(r["ppl"]) for r in doc["results"])
    assert "no-op" not in stderr  # the prompts have images: the text prior ranks them


def test_text_calibration_has_no_image_share(tiny_llama_dir, tmp_path, monkeypatch, capsys) -> None:
    rng = random.Random(4)
    data = write_jsonl(tmp_path / "text.jsonl", [{"prompt": words(rng, 30)} for _ in range(2)])
    out = tmp_path / "text.yaml"
    code, _, stderr = run(monkeypatch, capsys, "calibrate", str(tiny_llama_dir), "--budget", "0.5", "--samples", "2",
                          "--data", str(data), "--out", str(out))
    assert code == 0, stderr
    assert "image_share" not in out.read_text()
    code, stdout, _ = run(monkeypatch, capsys, "inspect", "gini", str(out), "--json")
    assert code == 0 and all("image_share" not in layer for layer in json.loads(stdout)["layers"])
    code, stdout, _ = run(monkeypatch, capsys, "inspect", "gini", str(out))
    assert code == 0 and "Image" not in stdout


def test_lookm_on_a_text_model_says_the_prior_is_a_no_op(tiny_llama_dir, tmp_path, monkeypatch, capsys) -> None:
    rng = random.Random(5)
    data = write_jsonl(tmp_path / "text.jsonl", [{"prompt": words(rng, 40)} for _ in range(2)])
    code, stdout, stderr = run(monkeypatch, capsys, "eval", str(tiny_llama_dir), "--data", str(data), "--budgets", "0.5",
                               "--methods", "elastic,lookm", "--max-new-tokens", "3")
    assert code == 0, stderr
    notes = [line for line in stderr.splitlines() if "no-op" in line]
    assert len(notes) == 1 and "text-only model" in notes[0] and "similarity-pivot" in notes[0]
    assert "lookm" in stdout


# ----- bad input ---------------------------------------------------------------------------------


BAD_INPUT = {
    "missing": ({"prompt": "the cat sat", "images": ["nowhere.png"]}, "llava", "image nowhere.png does not exist"),
    "not-an-image": ({"prompt": "the cat sat", "images": ["text.png"]}, "llava", "is not an image file Pillow can read"),
    "truncated": ({"prompt": "the cat sat", "images": ["cut.png"]}, "llava", "cannot be read"),
    "text-model": ({"prompt": "the cat sat", "images": ["a.png"]}, "text", "is a text-only model"),
    "no-processor": ({"prompt": "the cat sat", "images": ["a.png"]}, "bare-llava", "no processor was found"),
    "more-placeholders": ({"prompt": "<image> the cat <image> sat", "images": ["a.png"]}, "llava",
                          "the prompt has 2 <image> placeholders but 1 image (more placeholders than images)"),
    "fewer-placeholders": ({"prompt": "<image> the cat sat", "images": ["a.png", "a.png"]}, "llava",
                           "the prompt has 1 <image> placeholder but 2 images (fewer placeholders than images)"),
}


@pytest.fixture(scope="module")
def bare_llava_dir(tmp_path_factory, word_tokenizer) -> Path:
    """The tiny LLaVA saved without its processor (model and tokenizer only)."""
    tokenizer = word_tokenizer(("<image>",), with_pad=True)
    directory = save_tiny_llava(tmp_path_factory.mktemp("bare-llava"), tokenizer)
    (directory / "processor_config.json").unlink()
    return directory


@pytest.mark.parametrize("command", ["calibrate", "eval"])
@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_image_input_is_one_line(case, command, llava_dir, bare_llava_dir, tiny_llama_dir, tmp_path,
                                     monkeypatch, capsys) -> None:
    record, model, fragment = BAD_INPUT[case]
    png = write_png(tmp_path / "a.png", 16, 16, seed=0)
    (tmp_path / "text.png").write_text("not an image\n")
    (tmp_path / "cut.png").write_bytes(png.read_bytes()[:60])
    rng = random.Random(6)
    data = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": words(rng, 30)}, record])
    directory = {"llava": llava_dir, "bare-llava": bare_llava_dir, "text": tiny_llama_dir}[model]
    if command == "calibrate":
        args = ["calibrate", str(directory), "--budget", "0.5", "--samples", "2", "--out", str(tmp_path / "p.yaml")]
    else:
        args = ["eval", str(directory), "--budgets", "0.5", "--methods", "elastic", "--max-new-tokens", "2"]
    code, stdout, stderr = run(monkeypatch, capsys, *args, "--data", str(data))
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], stderr
    assert "bad.jsonl line 2" in lines[0] and "Traceback" not in stderr
    assert not (tmp_path / "p.yaml").exists()
