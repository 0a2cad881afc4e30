"""The model a server runs: its tokenizer's prompt format, its context, and one fresh cache per request.

A request's cache is what `kvtool generate` would give that request alone: the profile's kvtool
cache (its prompt compressed with the profile's draft, when it has one), or, for a prompt too short
for compression to save memory (`runtime.memory.too_short_to_compress`), a cache that keeps every
entry. The server runs every cache as kvtool layers, budget 1.0 included (a layer at ratio 1.0
keeps each entry and attends as the model's own cache does), so requests of any length decode in
one batch (`serve.batch`). Without a profile the server is the full cache: the budget-1.0 profile.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvtool.errors import KvtoolError
from kvtool.models.loader import eos_token_ids
from kvtool.models.prompts import default_bos, format_prompts
from kvtool.profiles import Draft, Profile
from kvtool.runtime import KvtoolCache, attach, uniform_profile
from kvtool.runtime.attach import layer_plans, layer_queries
from kvtool.runtime.layer.slots import GROWTH_SLOTS
from kvtool.runtime.layer.stored import EntryStorage
from kvtool.runtime.memory import SHORT_PROMPT_SHARE, kv_bytes_per_token
from kvtool.runtime.split import splittable
from kvtool.serve.admission import KvFootprint, LayerShare


@dataclass(frozen=True)
class RequestCache:
    """How one request runs: its cache factory, the draft (None: the prompt's own attention), its
    footprint for admission, and whether requests of one kind share a prompt phase (`shares_prompt`:
    their caches split into rows after it, `runtime.split`)."""

    make: Any
    draft: Draft | None
    footprint: KvFootprint
    shares_prompt: bool = False

    def prompt_bytes(self, rows: int, tokens: int) -> int:
        """What a prompt phase of `rows` rows padded to `tokens` holds beyond these caches (admission)."""
        draft = self.draft
        return self.footprint.prompt_phase(rows, tokens + (draft.tokens if draft else 0), held=draft is not None)

    @property
    def kind(self) -> tuple:
        """What requests whose prompt phases run as one batch must share: the cache and the draft."""
        return (self.make, self.draft)


class ServedModel:
    """A loaded model switched to kvtool attention for `profile` (None: the full cache)."""

    def __init__(
        self, loaded: Any, profile: Profile | None, cache_note: str = "full (uncompressed) cache", *, min_kept: int = 0
    ):
        """`min_kept`: the floor of entries per compressing layer (`attach`'s), counted in admission."""
        self.loaded = loaded
        self.model, self.tokenizer, self.name = loaded.model, loaded.tokenizer, loaded.name
        model = self.model
        full = uniform_profile(model, 1.0)
        self.profile = profile or full
        self.cache_note = cache_note + (f"; at least {min_kept} entries per layer" if min_kept and profile else "")
        floor = min_kept if profile else 0
        self.handle = attach(model, self.profile, min_kept=floor)
        self._full_plans = layer_plans(full, 0, layer_queries(model, full))
        self.compressed = profile is not None and any(
            layer.compress and layer.ratio < 1.0 or layer.window is not None for layer in profile.layers
        )
        self.eos = eos_token_ids(model, self.tokenizer)
        text = model.config.get_text_config(decoder=True)
        self.context = int(getattr(text, "max_position_embeddings", 0) or 0) or None
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        # Prompts shorter than this keep every entry, as `kvtool generate` leaves them (runtime.memory).
        self.short_tokens = SHORT_PROMPT_SHARE * weights / kv_bytes_per_token(model)
        plans = layer_plans(self.profile, floor, layer_queries(model, self.profile))  # what bare_cache's layers follow
        self.compressed_cache = RequestCache(
            self.handle.bare_cache, self.profile.method.draft, self._footprint(plans), splittable(self.handle.bare_cache())
        )

        def make_full() -> KvtoolCache:
            return KvtoolCache(model.config, self._full_plans)

        self.full_cache = RequestCache(make_full, None, self._footprint(self._full_plans), splittable(make_full()))

    def cache_for(self, prompt_tokens: int, max_tokens: int, sampling: bool) -> RequestCache:
        """The cache one request of `prompt_tokens` tokens runs with, as `kvtool generate` chooses it."""
        if prompt_tokens * 1.0 < self.short_tokens or not self.compressed:
            return self.full_cache
        chosen = self.compressed_cache
        draft = chosen.draft
        if draft is not None and max_tokens <= 1:
            draft = None
        elif draft is not None:
            draft = draft.capped(max_tokens)
            if draft.verify and sampling:
                draft = dataclasses.replace(draft, verify=False)  # a sampled answer does not start with the greedy one
        return dataclasses.replace(chosen, draft=draft)

    def projected_bytes(self, prompt_tokens: int, max_tokens: int) -> int:
        return self.cache_for(prompt_tokens, max_tokens, False).footprint.projected(prompt_tokens + max_tokens)

    def prompt_bytes(self, prompt_tokens: int, max_tokens: int, sampling: bool = False) -> int:
        """What this request's prompt phase alone holds beyond its cache (`RequestCache.prompt_bytes`)."""
        return self.cache_for(prompt_tokens, max_tokens, sampling).prompt_bytes(1, prompt_tokens)

    def _footprint(self, plans: list) -> KvFootprint:
        model = self.model
        text = model.config.get_text_config(decoder=True)
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        itemsize = model.dtype.itemsize
        native = 2 * heads * head_dim * itemsize
        layers = []
        for kind, plan in zip(self.profile.model.layer_types, plans):
            if plan is None:
                window = getattr(text, "sliding_window", None) if kind == "sliding_attention" else None
                layers.append(LayerShare(ratio=1.0, entry_bytes=native, window=window, compressing=False))
                continue
            storage = EntryStorage(*plan.storage)
            keys, values = storage.entry_bytes(head_dim, itemsize)
            layers.append(LayerShare(
                ratio=plan.ratio, entry_bytes=heads * (keys + values), floor=plan.min_kept,
                window=None if plan.cap is None else plan.cap + 1, growth=GROWTH_SLOTS,
                prompt_entry_bytes=native, keeps_prompt=plan.ratio >= 1.0 and plan.cap is None and not storage.quantized,
            ))
        return KvFootprint(tuple(layers))

    # ----- prompts ---------------------------------------------------------------------------

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """A chat's token ids, ending where the assistant's reply begins. One user turn is exactly
        `kvtool generate`'s prompt (`format_prompts`); longer chats go through the chat template,
        else "Role: text" lines."""
        tokenizer = self.tokenizer
        if len(messages) == 1 and messages[0]["role"] == "user":
            text = format_prompts(tokenizer, [messages[0]["content"]])[0]
        elif tokenizer.chat_template:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            turns = "".join(f"{m['role'].title()}: {m['content']}\n" for m in messages)
            text = default_bos(tokenizer) + turns + "Assistant:"
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def text_ids(self, prompt: str) -> list[int]:
        """A raw completion prompt's ids (the tokenizer's own special tokens added, BOS for most)."""
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def check_ids(self, ids: list[int], max_tokens: int) -> None:
        """One-line KvtoolError for a prompt the model cannot take."""
        if not ids:
            raise KvtoolError("the prompt is empty")
        vocab = self.model.config.get_text_config(decoder=True).vocab_size
        if any(not 0 <= int(t) < vocab for t in ids):
            raise KvtoolError(f"prompt token ids must be in [0, {vocab})")
        if self.context is not None and len(ids) + max_tokens > self.context:
            raise KvtoolError(
                f"the prompt's {len(ids)} tokens and max_tokens {max_tokens} exceed the model's context of {self.context} tokens"
            )

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([t for t in ids if t not in self.eos], skip_special_tokens=True)

    def close(self) -> None:
        self.handle.detach()
