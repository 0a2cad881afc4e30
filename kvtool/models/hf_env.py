"""Keep Hugging Face libraries offline and quiet, so `--json` stdout stays pure JSON.

Importing kvtool changes nothing in the process environment: a library user's settings are theirs.
The `kvtool` command calls `use_offline_defaults()` first thing; library code that wants the same
behaviour calls it itself, before anything imports `transformers` or `huggingface_hub`.
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


def use_offline_defaults() -> None:
    """Set kvtool's defaults for the Hugging Face libraries in `os.environ`: offline hub, no telemetry,
    no progress bars, transformers logging at `error`, no tokenizers fork warning.

    Call it before `transformers`, `huggingface_hub` or `tqdm` are first imported: they read these
    variables into module constants once, so a later call changes the environment but not their
    behaviour. Variables already set (by the user) are left as they are.
    """
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def quiet_transformers() -> None:
    """Silence transformers' logger and tqdm bars (they otherwise write to stderr mid-output)."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
