"""What one `kvtool bench` run measures: checked up front, one-line KvtoolError on bad input."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtool.errors import KvtoolError

MIN_PROMPT_TOKENS = 16
# The warm-up runs each cache once on a short prompt before anything is timed.
WARMUP_PROMPT_TOKENS = 256
WARMUP_NEW_TOKENS = 4


@dataclass(frozen=True)
class BenchConfig:
    """Prompt length and batch of the measured runs, decode steps per run, and measured repeats.

    Each run is one prompt forward (`prompt_tokens` per row, `batch` rows, no padding) followed by
    `new_tokens` one-token greedy decode forwards.
    """

    prompt_tokens: int = 4096
    new_tokens: int = 64
    batch: int = 4
    repeat: int = 3
    # After the runs, the three caches decode `new_tokens` steps again, in turns (`run_bench`).
    side_by_side: bool = True

    def __post_init__(self) -> None:
        if self.prompt_tokens < MIN_PROMPT_TOKENS:
            raise KvtoolError(f"--prompt-tokens must be at least {MIN_PROMPT_TOKENS}, got {self.prompt_tokens}")
        for flag, value in (("--new-tokens", self.new_tokens), ("--batch", self.batch), ("--repeat", self.repeat)):
            if value < 1:
                raise KvtoolError(f"{flag} must be at least 1, got {value}")

    def check_fits(self, model: Any) -> None:
        """The prompt and every decoded position must lie within the model's max_position_embeddings."""
        config = model.config.get_text_config(decoder=True)
        limit = getattr(config, "max_position_embeddings", None)
        if limit is None:
            return
        if self.prompt_tokens > limit:
            raise KvtoolError(
                f"--prompt-tokens {self.prompt_tokens} is larger than the model's max_position_embeddings ({limit})"
            )
        if self.prompt_tokens + self.new_tokens > limit:
            raise KvtoolError(
                f"--prompt-tokens {self.prompt_tokens} + --new-tokens {self.new_tokens} exceed the model's "
                f"max_position_embeddings ({limit})"
            )

    @property
    def total_runs(self) -> int:
        """Progress steps: a warm-up and `repeat` measured runs for each of the three caches, and the
        side-by-side decode's three prompt phases."""
        return 3 * (1 + self.repeat) + (3 if self.side_by_side else 0)
