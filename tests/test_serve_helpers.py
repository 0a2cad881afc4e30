"""Helpers for the serve tests (no tests here): a tiny random Llama with the word tokenizer as a
served model, and a way to follow jobs to their end."""

from __future__ import annotations

import threading

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import make_word_tokenizer
from kvtool.models.loader import LoadedModel, prepare_tokenizer
from kvtool.serve import Job

WORDS = "once upon a time there was the cat and it sat on the mat".split()


def tiny_loaded(context: int = 256, seed: int = 2) -> LoadedModel:
    tokenizer = make_word_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        # Weights far from zero: a random model's greedy tokens then depend on every position and
        # entry (at the default 0.02 it repeats one token whatever it attends to).
        initializer_range=0.3,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    return LoadedModel(model=model, tokenizer=prepare_tokenizer(tokenizer), name="tiny", source="test")


def prompt_ids(tokenizer, length: int, seed: int) -> list[int]:
    """BOS and `length` random words."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(WORDS), (length,), generator=g).tolist()
    return [tokenizer.bos_token_id] + tokenizer.convert_tokens_to_ids([WORDS[i] for i in picks])


class Run:
    """A job's events as they come; `done` is set at its last event."""

    def __init__(self, job: Job, on_text=None):
        self.job, self.events, self.done = job, [], threading.Event()
        self.on_text = on_text
        job.emit = self._emit

    def _emit(self, kind, payload) -> None:
        self.events.append((kind, payload))
        if kind == "text" and self.on_text is not None:
            self.on_text(self)
        if kind != "text":
            self.done.set()

    @property
    def text(self) -> str:
        return "".join(p for k, p in self.events if k == "text")

    @property
    def last(self):
        return self.events[-1]


def until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens
