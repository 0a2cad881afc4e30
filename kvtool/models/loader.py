"""Load a resolved model + tokenizer ready for batched generation (eval, sdpa, left padding).

A directory (or cached hub id) whose config is a vision-language one (a `vision_config` and a class
`AutoModelForImageTextToText` knows) loads as that model, with the processor saved beside it when
`AutoProcessor` finds one offline (`LoadedModel.processor`; None for text models and for a VLM saved
without its processor, which then takes text prompts only). Text models load exactly as before.

torch and transformers are imported inside the functions that use them: importing kvtool.models
stays cheap for `kvtool --help`, and loads nothing that reads the environment before the CLI has
called `use_offline_defaults()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtool.errors import KvtoolError
from kvtool.models.convert import ensure_converted
from kvtool.models.hf_env import quiet_transformers
from kvtool.models.resolve import DEFAULT_MODEL, ModelSource, resolve

if TYPE_CHECKING:
    import torch

# Names of torch dtypes, looked up when a model loads (torch is imported there, see above).
_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for `generate`: `name` is what the user asked for, `source` where it came from."""

    model: Any
    tokenizer: Any
    name: str
    source: str
    # The processor of a vision-language model (images -> pixel values, image placeholders expanded);
    # its tokenizer is `tokenizer`. None for text-only models.
    processor: Any = None


def _as_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    import torch

    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return getattr(torch, _DTYPES[dtype.lower()])
    except KeyError:
        raise KvtoolError(f"unknown dtype '{dtype}' (use one of: {', '.join(_DTYPES)})") from None


def prepare_tokenizer(tokenizer: Any) -> Any:
    """Left padding keeps every prompt's last token in the final column, where generation continues."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise KvtoolError("the tokenizer has neither a pad nor an eos token; cannot batch prompts")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def stop_at_end_of_turn(model: Any, tokenizer: Any) -> None:
    """Gemma chat turns end with <end_of_turn>, which GGUF metadata does not list as an EOS.

    Gemma's own generation config stops on both; without it, replies run on into a fake next turn.
    """
    if not model.config.model_type.startswith("gemma"):
        return
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    if end_of_turn is None or end_of_turn == tokenizer.unk_token_id:
        return
    eos = model.generation_config.eos_token_id
    eos_ids = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
    if end_of_turn not in eos_ids:
        model.generation_config.eos_token_id = [*eos_ids, end_of_turn]


def is_vision_language(config: Any) -> bool:
    """A config `AutoModelForImageTextToText` builds a model for, with a vision tower."""
    from transformers import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    return getattr(config, "vision_config", None) is not None and type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING


def _load_from(where: str, source: ModelSource, dtype: torch.dtype) -> tuple[Any, Any, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    options: dict[str, Any] = {"local_files_only": True}
    if source.hub_cache is not None:
        options["cache_dir"] = source.hub_cache
    processor = None
    try:
        vision = source.kind != "gguf" and is_vision_language(AutoConfig.from_pretrained(where, **options))
        if vision:
            from transformers import AutoModelForImageTextToText

            processor = _processor(where, options)
            tokenizer = processor.tokenizer if processor is not None else AutoTokenizer.from_pretrained(where, **options)
            model = _from_pretrained(AutoModelForImageTextToText, where, dtype, options)
        else:
            tokenizer = AutoTokenizer.from_pretrained(where, **options)
            model = _from_pretrained(AutoModelForCausalLM, where, dtype, options)
    except (OSError, ValueError, KeyError) as exc:
        # transformers raises these for unreadable/unsupported checkpoints; keep it to one line.
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise KvtoolError(f"cannot load model '{source.name}' from {where}: {first_line}") from exc
    return model, tokenizer, processor


def _from_pretrained(auto: Any, where: str, dtype: Any, options: dict[str, Any]) -> Any:
    """The model with sdpa attention, or its own eager attention where the family refuses sdpa
    (Gemma 2's soft-capping, gpt-oss's sinks: transformers raises a ValueError naming sdpa)."""
    try:
        return auto.from_pretrained(where, dtype=dtype, attn_implementation="sdpa", **options)
    except ValueError as exc:
        if "sdpa" not in str(exc).lower() and "scaled_dot_product" not in str(exc).lower():
            raise
        return auto.from_pretrained(where, dtype=dtype, attn_implementation="eager", **options)


def _processor(where: str, options: dict[str, Any]) -> Any:
    """The directory's processor, or None when it has none (or only a tokenizer)."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(where, **options)
    except (OSError, ValueError, KeyError, TypeError, ImportError):
        return None
    # Without a processor config AutoProcessor falls back to the bare tokenizer: that is no processor.
    if getattr(processor, "image_processor", None) is None or getattr(processor, "tokenizer", None) is None:
        return None
    return processor


def load_model(spec: str = DEFAULT_MODEL, *, dtype: torch.dtype | str | None = None) -> LoadedModel:
    """Load `spec` (alias, HF directory, .gguf file, or locally cached hub id) for generation.

    GGUF files are dequantized once into `$KVTOOL_CACHE` (default ~/.cache/kvtool); later loads
    read that directory. The model is in eval mode with sdpa attention, float32 unless `dtype`.
    """
    torch_dtype = _as_dtype(dtype)
    source = resolve(spec)
    quiet_transformers()
    if source.kind == "gguf":
        where = str(ensure_converted(Path(source.location)))
        description = f"gguf {source.location} (converted: {where})"
    elif source.kind == "hub":
        where = source.location
        description = f"hub id {source.location} (local cache {source.hub_cache})"
    else:
        where = source.location
        description = f"directory {Path(source.location).resolve()}"
    model, tokenizer, processor = _load_from(where, source, torch_dtype)
    model.eval()
    stop_at_end_of_turn(model, tokenizer)
    if processor is not None:
        description += f" (vision-language, processor {type(processor).__name__})"
    return LoadedModel(
        model=model, tokenizer=prepare_tokenizer(tokenizer), name=source.name, source=description, processor=processor
    )


def eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """Token ids that end a generation: the model's generation config, else the tokenizer's EOS."""
    configured = model.generation_config.eos_token_id
    if configured is None:
        configured = tokenizer.eos_token_id
    if configured is None:
        return set()
    return {int(t) for t in configured} if isinstance(configured, (list, tuple)) else {int(configured)}


def as_loaded(model: Any, who: str = "kvtool") -> LoadedModel:
    """`model` as a LoadedModel: a spec (alias, directory, .gguf, hub id) is loaded now; anything
    with `model`, `tokenizer` and `name` is taken as it is. `who` names the caller in the error."""
    if isinstance(model, (str, Path)):
        return load_model(str(model))
    if not all(hasattr(model, attr) for attr in ("model", "tokenizer", "name")):
        raise KvtoolError(f"{who} needs a model spec or a LoadedModel, got {type(model).__name__}")
    return model
