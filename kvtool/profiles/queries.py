"""Per-head query statistics learned by calibration: what Expected Attention needs from data.

For each compressing layer and query head: the mean and covariance of the pre-RoPE queries
calibration's prompts produced (`kvtool.calibration.queries` records them), and the mean norm of each
RoPE frequency's pair of dimensions, E|q_f| (TriAttention's norm term; profiles calibrated before it
was recorded have none). They are tensors, too
big for YAML, so a profile names a sidecar file beside it (`<profile>.queries.safetensors`) with
its SHA-256, and the file carries the model's shape: a profile whose sidecar is missing, altered
or made for another shape is refused in one line. Covariances are stored in float16 (half the
bytes; the score is a ranking, and a test bounds the error); means in float32.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvtool.errors import KvtoolError
from kvtool.files import write_bytes_atomic

if TYPE_CHECKING:  # torch loads only with the statistics: `kvtool --help` reads profiles' schema without it
    import torch

SUFFIX = ".queries.safetensors"
# Expected Attention averages RoPE over this many positions after the prompt (kvpress's default).
FUTURE_POSITIONS = 512


@dataclass(frozen=True, eq=False)
class QueryStats:
    """layers: the decoder layers described, in order; mean [L, Hq, D]; cov [L, Hq, D, D] (the
    population covariance of each head's pre-RoPE queries); queries: how many query rows (tokens)
    they were measured on; future: the positions after the prompt RoPE is averaged over;
    pair_norm [L, Hq, D/2] or None: the mean norm of each head's pair of dimensions RoPE turns
    together (dimension i with i + D/2)."""

    layers: tuple[int, ...]
    mean: torch.Tensor
    cov: torch.Tensor
    queries: int
    future: int = FUTURE_POSITIONS
    pair_norm: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, heads, dim = self.mean.shape
        if len(self.layers) != n or tuple(self.cov.shape) != (n, heads, dim, dim):
            raise KvtoolError(
                f"query statistics disagree: {len(self.layers)} layers, means {tuple(self.mean.shape)}, "
                f"covariances {tuple(self.cov.shape)}"
            )
        if self.pair_norm is not None and tuple(self.pair_norm.shape) != (n, heads, dim // 2):
            raise KvtoolError(f"query statistics disagree: means {tuple(self.mean.shape)}, pair norms {tuple(self.pair_norm.shape)}")

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(mean [Hq, D], cov [Hq, D, D]) of decoder layer `index`, float32; None if not described."""
        if index not in self.layers:
            return None
        i = self.layers.index(index)
        return self.mean[i].float(), self.cov[i].float()

    def pair_norms(self, index: int) -> torch.Tensor | None:
        """[Hq, D/2] float32 of decoder layer `index`; None if not described or not recorded."""
        if self.pair_norm is None or index not in self.layers:
            return None
        return self.pair_norm[self.layers.index(index)].float()

    @property
    def nbytes(self) -> int:
        """Bytes as stored (float32 means and pair norms, float16 covariances)."""
        pairs = 0 if self.pair_norm is None else self.pair_norm.numel() * 4
        return self.mean.numel() * 4 + self.cov.numel() * 2 + pairs


def sidecar_path(profile_path: str | Path) -> Path:
    path = Path(profile_path)
    return path.with_name(path.name.removesuffix(path.suffix) + SUFFIX)


def save_query_stats(stats: QueryStats, path: str | Path, *, heads: int, head_dim: int) -> str:
    """Write `stats` atomically to `path`; returns the file's SHA-256 (hex)."""
    import torch
    from safetensors.torch import save

    cov = stats.cov.float()
    if not bool(torch.isfinite(cov.half()).all()):
        raise KvtoolError("query covariances overflow float16; this model's queries are too large to store")
    tensors = {"mean": stats.mean.float().contiguous(), "cov": cov.half().contiguous()}
    if stats.pair_norm is not None:
        tensors["pair_norm"] = stats.pair_norm.float().contiguous()
    metadata = {
        "layers": json.dumps(list(stats.layers)), "queries": str(stats.queries), "heads": str(heads), "head_dim": str(head_dim),
    }
    data = _canonical(save(tensors, metadata=metadata))
    write_bytes_atomic(path, data, what="query statistics")
    return hashlib.sha256(data).hexdigest()


def _canonical(data: bytes) -> bytes:
    """`data` (a safetensors file) with its JSON header's keys sorted. safetensors writes the metadata
    in hash order, which changes from process to process: the same statistics saved twice would get
    two digests, and a profile saved again would name another file. The tensors' offsets count from
    the end of the header, so a header of another length (padded to 8 bytes, as the format asks)
    leaves them valid."""
    size = int.from_bytes(data[:8], "little")
    header = json.dumps(json.loads(data[8 : 8 + size]), sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + data[8 + size :]


def load_query_stats(path: str | Path, sha256: str, *, heads: int, head_dim: int, future: int) -> QueryStats:
    """Read a sidecar written by `save_query_stats` (`future`: the profile's setting); a one-line
    KvtoolError if it is missing, is not the file the profile names (hash), or describes another shape."""
    source = Path(path)
    try:
        data = source.read_bytes()
    except OSError as exc:
        raise KvtoolError(f"cannot read the profile's query statistics {source}: {exc.strerror or exc}") from None
    if hashlib.sha256(data).hexdigest() != sha256:
        raise KvtoolError(f"{source} is not the query-statistics file its profile was saved with (SHA-256 differs)")
    from safetensors.torch import load

    try:
        tensors = load(data)
        header = int.from_bytes(data[:8], "little")
        metadata = json.loads(data[8 : 8 + header]).get("__metadata__") or {}
        layers = tuple(int(i) for i in json.loads(metadata["layers"]))
        queries = int(metadata["queries"])
        shape = (int(metadata["heads"]), int(metadata["head_dim"]))
    except Exception as exc:  # a corrupt file raises many kinds of errors; all mean the same here
        raise KvtoolError(f"{source}: not a kvtool query-statistics file ({exc})") from None
    if shape != (heads, head_dim):
        raise KvtoolError(f"{source} describes {shape[0]} query heads of dimension {shape[1]}; the model has {heads} of {head_dim}")
    return QueryStats(layers, tensors["mean"], tensors["cov"], queries, future, tensors.get("pair_norm"))
