"""The request bodies the server takes (OpenAI's chat and completion requests, the fields it serves).

Unknown fields are refused rather than ignored: a client that asks for something (logprobs, tools)
should hear that it does not get it. Every problem is one line (`one_line`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# max_tokens when the request gives none (OpenAI's completions default is 16; a reply's default
# here is longer, but bounded, since admission reserves memory for every token a request may take).
DEFAULT_MAX_TOKENS = 256


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    seed: int | None = None
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("n must be 1: this server returns one choice per request")
        return n

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop):
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError("stop takes at most 4 sequences")
        return stop

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer"]
    content: str
    name: str | None = None


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    echo: bool = False

    @property
    def limit(self) -> int | None:
        return self.max_tokens

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ValueError("one prompt per request (send each prompt as its own request)")
            return prompt[0]
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo


def one_line(exc: ValidationError) -> str:
    """The first problem pydantic found, as `field: message` on one line."""
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error.get("loc", ()) if part not in ("body",))
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    if error.get("type") == "extra_forbidden":
        message = "unknown field (not supported by this server)"
    text = f"{where}: {message}" if where else message
    return " ".join(text.split())
