"""The `inspect gini --plot` figure: Lorenz curves per layer (PrefixKV Fig. 2) and ratio + Gini per layer (Fig. 4)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvtool.errors import KvtoolError
from kvtool.profiles import Profile

EXTRA_HINT = "pip install 'kvtool[plot]'"


def require_matplotlib() -> None:
    """Fail early, before any model work, when the optional plotting extra is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise KvtoolError(f"--plot needs matplotlib, which is the optional extra kvtool[plot]: {EXTRA_HINT}") from None


def plot_profile(profile: Profile, path: Path) -> Path:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    from kvtool.profiles.lorenz import grid, lorenz_curve

    compressed = [(i, layer) for i, layer in enumerate(profile.layers) if layer.compress and layer.priority_curve]
    if not compressed:
        raise KvtoolError("this profile stores no priority curves (uniform profile?): nothing to plot; calibrate one first")
    budget = profile.budget
    p = profile.calibration.retention_p if profile.calibration else None

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2))
    colors = plt.get_cmap("viridis")(np.linspace(0.0, 1.0, len(compressed)))
    for (index, layer), color in zip(compressed, colors):
        curve = np.asarray(layer.priority_curve)
        x = grid(len(curve))
        lorenz = lorenz_curve(curve)
        left.plot(x, lorenz, color=color, linewidth=1.0, label=f"layer {index}" if len(compressed) <= 12 else None)
        # Uniform ratio: every layer keeps the top `budget` share of tokens; what it drops is the
        # Lorenz value at 1 - budget, different for every layer.
        left.plot(1.0 - budget, np.interp(1.0 - budget, x, lorenz), "o", color=color, markersize=4)
        # PrefixKV: each layer at its own ratio, which drops the same share 1 - p of importance in
        # every layer (layers held up by the minimum ratio drop less, so their marks sit lower).
        left.plot(1.0 - layer.ratio, np.interp(1.0 - layer.ratio, x, lorenz), "x", color=color, markersize=5)
    left.plot([0, 1], [0, 1], "k--", linewidth=1, label="equality")
    left.axvline(1.0 - budget, color="grey", linestyle=":", linewidth=1, label=f"uniform ratio {budget:g} (o)")
    if p is not None:
        left.axhline(1.0 - p, color="tab:red", linestyle=":", linewidth=1, label=f"PrefixKV retention p={p:.3f} (x)")
    left.set(
        xlabel="fraction of tokens, least important first",
        ylabel="cumulative share of importance",
        title="Lorenz curves of attention importance per layer",
        xlim=(0, 1),
        ylim=(0, 1),
    )
    left.legend(fontsize=7, loc="upper left")

    layers = [index for index, _ in compressed]
    ratios = [layer.ratio for _, layer in compressed]
    ginis = [layer.gini if layer.gini is not None else np.nan for _, layer in compressed]
    right.bar(layers, ratios, color="tab:blue", alpha=0.7, label="kept ratio")
    right.axhline(budget, color="tab:blue", linestyle=":", linewidth=1, label=f"budget {budget:g}")
    right.set(xlabel="layer", ylabel="kept ratio", title="Per-layer kept ratio and Gini coefficient")
    twin = right.twinx()
    twin.plot(layers, ginis, "o-", color="tab:orange", label="Gini")
    twin.set_ylabel("Gini")
    handles = right.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    right.legend(handles=handles, fontsize=8, loc="upper right")
    fig.suptitle(f"{profile.model.name} · budget {budget:g}", fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise KvtoolError(f"cannot write plot to {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return path
