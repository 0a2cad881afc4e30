"""`kvtool export PROFILE --engine vllm|trtllm`: what a serving engine can hold of a profile, as that
engine's own command line (vLLM) or config file (TensorRT-LLM), and what stays behind."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kvtool.cli.app import app


@app.command("export")
def export_command(
    profile: Annotated[Path, typer.Argument(help="A profile YAML (kvtool calibrate writes one).")],
    engine: Annotated[str, typer.Option("--engine", help="vllm (one `vllm serve` line) or trtllm (a YAML for trtllm-serve --extra_llm_api_options).")],
    model: Annotated[
        str | None, typer.Option("--model", help="What the engine loads: a hub id or a path (default: the checkpoint behind the profile's model).")
    ] = None,
    prompt_tokens: Annotated[
        int | None,
        typer.Option(
            "--prompt-tokens",
            help="The prompt length at which a layer's kept share becomes its window in tokens (share x N, rounded up; "
            "default: the profile's calibration prompts' mean length, else its budget_tokens, else 4096).",
        ),
    ] = None,
    max_seq_len: Annotated[
        int | None, typer.Option("--max-seq-len", help="trtllm: max_seq_len, and the window of a full-attention layer (default 8192).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the same as JSON.")] = False,
) -> None:
    """Print what a serving engine can hold of a profile: its command line or config, and what stays behind."""
    from kvtool.export import export_profile, get_engine
    from kvtool.runtime import load_profile

    get_engine(engine)  # an unknown engine before the profile is read
    exported = export_profile(load_profile(profile), engine, model=model, prompt_tokens=prompt_tokens, max_seq_len=max_seq_len)
    typer.echo(json.dumps(exported.data, indent=2, ensure_ascii=False) if as_json else exported.text)
