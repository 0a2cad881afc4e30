"""Dequantize a GGUF file once into a plain Hugging Face directory under the kvtool cache.

Loading a GGUF through transformers dequantizes every tensor on each run; the converted directory
reloads in about a second. A GGUF-loaded model refuses `save_pretrained`, so the weights are moved
into a model rebuilt from the same config minus its `quantization_config`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from rich.console import Console

from kvtool.models.hf_env import quiet_transformers

CACHE_ENV = "KVTOOL_CACHE"
_MARKER = "kvtool-gguf-source.json"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvtool").expanduser()


def converted_dir(gguf: Path) -> Path:
    """Cache location for this exact file: a new size or mtime means new weights, so a new key."""
    stat = gguf.stat()
    key = f"{gguf.name}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf.stem}-{digest}"


def _convert_into(gguf: Path, target: Path) -> None:
    quiet_transformers()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name)
    config = quantized.config.to_dict()
    config.pop("quantization_config", None)
    clean_config = type(quantized.config).from_dict(config)
    model = AutoModelForCausalLM.from_config(clean_config, dtype=quantized.dtype)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    (target / _MARKER).write_text(
        json.dumps({"gguf": str(gguf), "size": gguf.stat().st_size, "mtime_ns": gguf.stat().st_mtime_ns}) + "\n"
    )


def ensure_converted(gguf: Path, console: Console | None = None) -> Path:
    """Return the converted directory for `gguf`, converting it first if needed.

    The conversion is written to a temporary sibling and renamed into place, so the final
    directory exists only when complete. An error or Ctrl-C removes the temporary directory; a
    killed process may leave a `.tmp-*` directory, which is never read and is removed by a later
    conversion once it is an hour old.
    """
    target = converted_dir(gguf)
    if target.is_dir():
        return target
    console = console or Console(stderr=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(target.parent)
    message = f"converting GGUF once: {gguf.name} -> {target}"
    started = time.perf_counter()
    temp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        if console.is_terminal:
            with console.status(message):
                _convert_into(gguf, temp)
        else:
            console.print(message, soft_wrap=True)
            _convert_into(gguf, temp)
        # mkdtemp makes the directory private (0700); the finished cache gets normal permissions.
        umask = os.umask(0)
        os.umask(umask)
        temp.chmod(0o777 & ~umask)
        try:
            os.rename(temp, target)
        except OSError:
            # Another process finished the same conversion first; its copy is equally good.
            if not target.is_dir():
                raise
    finally:
        if temp.exists():
            shutil.rmtree(temp, ignore_errors=True)
    console.print(f"converted in {time.perf_counter() - started:.1f} s", style="dim", soft_wrap=True)
    return target


def _remove_stale_temps(parent: Path, older_than_s: float = 3600.0) -> None:
    # Only old ones: a young temp dir may belong to a conversion running in another process.
    now = time.time()
    for entry in parent.glob(".tmp-*"):
        try:
            if now - entry.stat().st_mtime > older_than_s:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            pass
