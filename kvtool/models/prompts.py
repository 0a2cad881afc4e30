"""Turn user prompts into the exact text a model expects (chat template or a plain fallback).

The returned strings already contain every special token the model needs (e.g. a leading BOS), so
they must be tokenized with `add_special_tokens=False` — the usual Hugging Face rule for rendered
chat templates, applied to the fallbacks too so there is exactly one rule.
"""

from __future__ import annotations

from typing import Any

from kvtool.errors import KvtoolError

# Gemma's real turn format; Gemma GGUF files often ship without the template string.
_GEMMA_TURN = "<start_of_turn>user\n{prompt}<end_of_turn>\n<start_of_turn>model\n"
_PLAIN = "User: {prompt}\nAssistant:"


def check_prompts(prompts: list[str]) -> None:
    if not prompts:
        raise KvtoolError("no prompt given")
    for index, prompt in enumerate(prompts, start=1):
        if not prompt.strip():
            raise KvtoolError(f"prompt {index} is empty")


def _has_tokens(tokenizer: Any, *tokens: str) -> bool:
    vocab = tokenizer.get_vocab()
    return all(token in vocab for token in tokens)


def default_bos(tokenizer: Any) -> str:
    """The BOS text the tokenizer would add on its own, or "" if it adds none."""
    bos = tokenizer.bos_token
    if bos is None:
        return ""
    ids = tokenizer("x", add_special_tokens=True)["input_ids"]
    return bos if ids and ids[0] == tokenizer.bos_token_id else ""


def format_prompts(tokenizer: Any, prompts: list[str]) -> list[str]:
    """One user turn per prompt, ending where the assistant's reply should begin."""
    check_prompts(prompts)
    if tokenizer.chat_template:
        return [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            for prompt in prompts
        ]
    if _has_tokens(tokenizer, "<start_of_turn>", "<end_of_turn>"):
        bos = tokenizer.bos_token or ""
        return [bos + _GEMMA_TURN.format(prompt=prompt) for prompt in prompts]
    bos = default_bos(tokenizer)
    return [bos + _PLAIN.format(prompt=prompt) for prompt in prompts]
