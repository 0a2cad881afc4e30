"""The `inspect gini --plot` figure: Lorenz curves per layer (PrefixKV Fig. 2) and, per layer, PrefixKV's and
the shipped ratio beside the Gini (Fig. 4)."""

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


def plot_profile(profile: Profile, path: Path, prefixkv: Profile | None = None, p: float | None = None,
                 *, shipped: bool = True) -> Path:
    """Left: each compressing layer's Lorenz curve, marked where PrefixKV's ratio (`prefixkv`: the
    profile with PrefixKV's ratios, `p` its retention level) and the shipped ratio cut it. Right: both
    ratios and the Gini per layer. `shipped` False: `profile` was measured now, and only PrefixKV's
    ratios are drawn."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    from kvtool.profiles.lorenz import grid, lorenz_curve

    compressed = [(i, layer) for i, layer in enumerate(profile.layers) if layer.compress and layer.priority_curve]
    if not compressed:
        raise KvtoolError("this profile stores no priority curves (uniform profile?): nothing to plot; calibrate one first")
    budget = profile.budget
    theirs = [prefixkv.layers[i].ratio if prefixkv is not None else np.nan for i, _ in compressed]
    ours = [layer.ratio for _, layer in compressed]

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2))
    colors = plt.get_cmap("viridis")(np.linspace(0.0, 1.0, len(compressed)))
    for (index, layer), color, prefix_ratio in zip(compressed, colors, theirs):
        curve = np.asarray(layer.priority_curve)
        x = grid(len(curve))
        lorenz = lorenz_curve(curve)
        left.plot(x, lorenz, color=color, linewidth=1.0, label=f"layer {index}" if len(compressed) <= 12 else None)
        # PrefixKV: each layer at its own ratio, which drops the same share 1 - p of importance in
        # every layer (layers held up by the minimum ratio drop less, so their marks sit lower).
        if np.isfinite(prefix_ratio):
            left.plot(1.0 - prefix_ratio, np.interp(1.0 - prefix_ratio, x, lorenz), "x", color=color, markersize=5)
        # The shipped ratio: what the layer drops of its importance there, whatever chose the ratio.
        if shipped:
            left.plot(1.0 - layer.ratio, np.interp(1.0 - layer.ratio, x, lorenz), "o", color=color, markersize=4,
                      markerfacecolor="none")
    left.plot([0, 1], [0, 1], "k--", linewidth=1, label="equality")
    if p is not None:
        left.axhline(1.0 - p, color="tab:red", linestyle=":", linewidth=1, label=f"PrefixKV retention p={p:.3f} (x)")
    if shipped:
        left.plot([], [], "o", color="grey", markerfacecolor="none", label="shipped ratio (o)")
    left.set(
        xlabel="fraction of tokens, least important first",
        ylabel="cumulative share of importance",
        title="Lorenz curves of attention importance per layer",
        xlim=(0, 1),
        ylim=(0, 1),
    )
    left.legend(fontsize=7, loc="upper left")

    layers = np.array([index for index, _ in compressed], dtype=np.float64)
    ginis = [layer.gini if layer.gini is not None else np.nan for _, layer in compressed]
    # Bars side by side at each layer's index; on a hybrid model only the full-attention layers carry
    # ratios, so the bars take the gap to the next compressing layer into account.
    gap = float(np.min(np.diff(layers))) if len(layers) > 1 else 1.0
    width = 0.4 * gap if shipped else 0.8 * gap
    offset = width / 2 if shipped else 0.0
    right.bar(layers - offset, theirs, width=width, color="tab:purple", alpha=0.75, label="PrefixKV ratio")
    if shipped:
        right.bar(layers + offset, ours, width=width, color="tab:cyan", alpha=0.75, label="shipped ratio")
    full_mean = float(np.mean(ours))
    right.axhline(full_mean, color="grey", linestyle=":", linewidth=1,
                  label=f"mean ratio {full_mean:.3f}" + ("" if abs(full_mean - budget) < 5e-3 else f" (budget {budget:g} of the whole cache)"))
    windows = sorted({layer.window for layer in profile.layers if layer.window is not None})
    kinds = "full-attention layers" if windows else "layer"
    right.set(xlabel=kinds, ylabel="kept ratio", title="Per-layer kept ratio and Gini coefficient")
    if windows:
        right.set_xticks(layers)
        right.set_title(f"Per-layer kept ratio and Gini (sliding layers: windows of {', '.join(map(str, windows))})")
    twin = right.twinx()
    twin.plot(layers, ginis, "o-", color="tab:orange", label="Gini")
    twin.set_ylabel("Gini")
    handles = right.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    right.legend(handles=handles, fontsize=8, loc="best")
    fig.suptitle(f"{profile.model.name} · budget {budget:g}" + (f" · shipped ratios: {profile.method.ratios}" if shipped else ""),
                 fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise KvtoolError(f"cannot write plot to {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return path
