"""`kvtool serve MODEL`: an OpenAI-compatible server on a kvtool profile (docs/serve.md)."""

from __future__ import annotations

from typing import Annotated

import typer

from kvtool.cli.app import app
from kvtool.cli.profile_choice import (
    BudgetOption, KvFormatOption, MinKeptOption, ModelArgument, ProfileOption, check_choice, choose_cache_profile,
)
from kvtool.errors import KvtoolError


@app.command("serve")
def serve_command(
    model: ModelArgument,
    budget: BudgetOption = None,
    profile: ProfileOption = None,
    kv_format: KvFormatOption = None,
    min_kept: MinKeptOption = 0,
    host: Annotated[str, typer.Option(help="Address to listen on (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to listen on.")] = 8000,
    kv_memory: Annotated[
        str | None,
        typer.Option("--kv-memory", help="KV bytes all running requests may hold together (2GiB, 512MiB, bytes); "
                     "a request is admitted when the bytes its cache will hold fit. Default: no limit but --max-batch."),
    ] = None,
    max_batch: Annotated[int, typer.Option("--max-batch", min=1, help="Most requests running at once.")] = 64,
) -> None:
    """Serve MODEL over OpenAI's HTTP API; requests share one batch, admitted by the KV bytes they will hold."""
    from kvtool.serve.admission import parse_size

    capacity = None if kv_memory is None else parse_size(kv_memory)  # before the slow model load
    check_choice(budget, profile, kv_format)
    import uvicorn

    from kvtool.models import load_model
    from kvtool.serve import Ledger, Scheduler, ServedModel, build_app
    from kvtool.units import human_bytes

    loaded = load_model(model)
    if loaded.processor is not None:
        raise KvtoolError("kvtool serve takes text models (this one reads images)")
    chosen = choose_cache_profile(loaded, budget, profile, kv_format)
    served = ServedModel(loaded, *(chosen or (None,)), min_kept=min_kept)
    scheduler = Scheduler(served, Ledger(capacity, max_batch))
    memory = "no KV memory limit" if capacity is None else f"KV memory {human_bytes(capacity)}"
    typer.echo(f"kvtool serve: {loaded.name} ({served.cache_note}; {memory}, at most {max_batch} at once) "
               f"on http://{host}:{port}/v1", err=True)
    config = uvicorn.Config(build_app(scheduler), host=host, port=port, log_level="warning", timeout_graceful_shutdown=None)
    uvicorn.Server(config).run()
