"""Find, load and prompt the models kvtool runs (aliases, HF directories, GGUF files, cached hub ids)."""

from kvtool.models.hf_env import configure_environment

# Before anything below can import transformers/huggingface_hub (they read these env vars once).
configure_environment()

from kvtool.models.loader import LoadedModel, eos_token_ids, load_model, prepare_tokenizer  # noqa: E402
from kvtool.models.prompts import format_prompts  # noqa: E402
from kvtool.models.resolve import ALIASES, DEFAULT_MODEL, ModelSource, resolve  # noqa: E402

__all__ = [
    "eos_token_ids",
    "ALIASES",
    "DEFAULT_MODEL",
    "LoadedModel",
    "ModelSource",
    "format_prompts",
    "load_model",
    "prepare_tokenizer",
    "resolve",
]
