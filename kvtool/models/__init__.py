"""Find, load and prompt the models kvtool runs (aliases, HF directories, GGUF files, cached hub ids).

Importing this package leaves `os.environ` alone; `use_offline_defaults()` sets kvtool's offline and
quiet Hugging Face defaults (the CLI calls it first; library users call it before importing transformers).
"""

from kvtool.models.hf_env import use_offline_defaults
from kvtool.models.loader import LoadedModel, eos_token_ids, load_model, prepare_tokenizer
from kvtool.models.prompts import format_prompts
from kvtool.models.resolve import ALIASES, DEFAULT_MODEL, ModelSource, resolve
from kvtool.models.vision import image_token_ids

__all__ = [
    "eos_token_ids",
    "ALIASES",
    "DEFAULT_MODEL",
    "LoadedModel",
    "ModelSource",
    "format_prompts",
    "image_token_ids",
    "load_model",
    "prepare_tokenizer",
    "resolve",
    "use_offline_defaults",
]
