"""TensorRT-LLM: a YAML file for `trtllm-serve MODEL --extra_llm_api_options FILE`.

`kv_cache_config.max_attention_window` is a list with one window per layer (one memory pool per
size; a full-attention layer's entry is `max_seq_len`), `kv_cache_config.dtype` the one KV dtype:
`auto` or `fp8` (e4m3 with one scale per tensor, 1.0 unless calibrated offline with ModelOpt).
There are no sinks (`sink_token_length` is ignored by the PyTorch backend) and no per-layer dtype.
"""

from __future__ import annotations

from typing import Any

import yaml

from kvtool.calibration.engine_emulation import FP8_TENSOR
from kvtool.errors import KvtoolError
from kvtool.export.base import Engine, Held

DEFAULT_MAX_SEQ_LEN = 8192
_FP8 = "TensorRT-LLM's fp8 KV has one scale per tensor (1.0 unless calibrated offline), kvtool's fp8 one per token and head"


class TrtLlm(Engine):
    name = "trtllm"

    def nearest(self, fmt: str) -> tuple[str, str | None]:
        if fmt == "native":
            return fmt, None
        if fmt == "fp8":
            return FP8_TENSOR, _FP8
        if fmt == "int8":
            return FP8_TENSOR, "TensorRT-LLM's PyTorch backend has no int8 KV: int8 layers stored at fp8 (the same bytes, one scale per tensor)"
        return FP8_TENSOR, f"TensorRT-LLM's 4-bit KV (nvfp4) needs offline ModelOpt calibration: {fmt} layers stored at fp8 (more bytes)"

    def format_note(self, fmt: str) -> str | None:
        return "fp8 as TensorRT-LLM stores it without calibrated scales (one scale of 1.0 per tensor)" if fmt == FP8_TENSOR else None

    def config(self, held: Held, max_seq_len: int | None = None) -> dict:
        longest = max((w for w in held.windows if w is not None), default=0)
        limit = max_seq_len if max_seq_len is not None else max(DEFAULT_MAX_SEQ_LEN, longest)
        if limit < longest:
            raise KvtoolError(f"--max-seq-len {limit} is shorter than the longest window ({longest} tokens)")
        kv: dict[str, Any] = {"dtype": held.kv_cache_dtype}
        if longest:
            kv["max_attention_window"] = [limit if w is None else w for w in held.windows]
        return {"max_seq_len": limit, "kv_cache_config": kv}

    def render(self, held: Held, *, max_seq_len: int | None = None, **options: Any) -> str:
        body = yaml.safe_dump(self.config(held, max_seq_len), sort_keys=False, default_flow_style=None, width=100)
        return "\n".join([
            f"# trtllm-serve {held.model} --extra_llm_api_options THIS_FILE",
            f"# holds: {held.holds}",
            f"# mapping: {held.mapping}",
            f"# stays behind: {held.stays_behind}",
            body.rstrip(),
        ])

    def data(self, held: Held, *, max_seq_len: int | None = None, **options: Any) -> dict:
        return {"config": self.config(held, max_seq_len), "command": f"trtllm-serve {held.model} --extra_llm_api_options FILE"}
