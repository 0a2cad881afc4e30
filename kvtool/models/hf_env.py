"""Keep Hugging Face libraries offline and quiet, so `--json` stdout stays pure JSON.

The environment defaults only take effect if set before `transformers`/`huggingface_hub` are
first imported (they read them into module constants), hence `configure_environment()` runs when
`kvtool.models` is imported. `setdefault` leaves any explicit user choice alone.
"""

from __future__ import annotations

import os

_ENV_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",  # kvtool never downloads; hub ids come from the local cache only
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",  # avoids the fork warning when tests spawn subprocesses
    # transformers' GGUF dequantizer uses a bare tqdm bar that its logging switches cannot reach;
    # tqdm reads this once, on import. kvtool reports progress through rich instead.
    "TQDM_DISABLE": "1",
}


def configure_environment() -> None:
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def quiet_transformers() -> None:
    """Silence transformers' logger and tqdm bars (they otherwise write to stderr mid-output)."""
    configure_environment()
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
