"""Passkey results as people read them: each variant's accuracy per (length, depth) cell, as a text table and as
heat maps (eval/needle/run.py writes both with every result)."""

from __future__ import annotations

from pathlib import Path

from h2o_stream.files import atomic_path


def accuracy_grid(results, variant, lengths, depths):
    grid = {}
    for length in lengths:
        for depth in depths:
            scores = [
                r["correct"]
                for r in results
                if r["variant"] == variant and r["length"] == length and r["depth"] == depth
            ]
            scores = [s for s in scores if s is not None]
            grid[(length, depth)] = sum(scores) / len(scores) if scores else None
    return grid


def table(results, variants, lengths, depths, budget) -> str:
    head = f"{'variant':10s} {'depth':>5s} " + " ".join(f"{f'{n}({n // budget}x)':>11s}" for n in lengths) + "   mean"
    lines = [head, "-" * len(head)]
    for variant in variants:
        grid = accuracy_grid(results, variant, lengths, depths)
        for depth in depths:
            row = [grid[(n, depth)] for n in lengths]
            cells = " ".join(f"{'n/a' if v is None else f'{v:.2f}':>11s}" for v in row)
            valid = [v for v in row if v is not None]
            mean = f"{sum(valid) / len(valid):.2f}" if valid else "n/a"
            lines.append(f"{variant:10s} {depth:5.2f} {cells}   {mean}")
        col = [[grid[(n, d)] for d in depths] for n in lengths]
        means = [
            (sum(v for v in c if v is not None) / len([v for v in c if v is not None]))
            if any(v is not None for v in c)
            else None
            for c in col
        ]
        lines.append(
            f"{variant:10s} {'all':>5s} " + " ".join(f"{'n/a' if v is None else f'{v:.2f}':>11s}" for v in means)
        )
        lines.append("")
    return "\n".join(lines)


def heatmap(results, variants, lengths, depths, budget, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    columns = min(len(variants), 5)
    rows = -(-len(variants) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.3 * columns + 1, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(variants) :]:
        ax.axis("off")
    cmap = plt.get_cmap("RdYlGn").with_extremes(bad="#cccccc")
    image = None
    for ax, variant in zip(axes.flat, variants, strict=False):
        grid = accuracy_grid(results, variant, lengths, depths)
        data = np.array([[np.nan if grid[(n, d)] is None else grid[(n, d)] for n in lengths] for d in depths])
        image = ax.imshow(np.ma.masked_invalid(data), cmap=cmap, vmin=0, vmax=1, aspect="auto")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                ax.text(
                    j, i, "n/a" if np.isnan(data[i, j]) else f"{data[i, j]:.1f}", ha="center", va="center", fontsize=8
                )
        ax.set_xticks(
            range(len(lengths)), [f"{n // 1024}k\n{n // budget}x" if n >= 1024 else str(n) for n in lengths], fontsize=8
        )
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=8)
        ax.set_xlabel("document length (tokens, x cache)", fontsize=8)
        ax.set_title(variant, fontsize=10)
    for row in axes:
        row[0].set_ylabel("needle depth", fontsize=8)
    fig.subplots_adjust(hspace=0.45)
    fig.colorbar(image, ax=axes.ravel().tolist(), fraction=0.03, label="passkey accuracy")
    fig.suptitle(title, fontsize=9)
    with atomic_path(path) as partial:
        fig.savefig(partial, dpi=130, bbox_inches="tight")
    plt.close(fig)
