"""Result files: the PPL-vs-tokens plot and the summary table (JSON goes through h2o_stream.files)."""

from __future__ import annotations

import os

from h2o_stream.files import atomic_path, write_json  # noqa: F401  (write_json re-exported for callers)


def plot_curves(results: list[dict], path: str | os.PathLike, title: str) -> None:
    """Running PPL vs tokens, one line per policy × cache size (H2O paper, Figure 5 style)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    styles = {"h2o": "-", "sink": "--", "window": ":", "full": "-."}
    for result in sorted(results, key=lambda r: (r["settings"]["policy"], _size(r))):
        curve = result["curve"]
        if not curve:
            continue
        settings = result["settings"]
        ax.plot([c[0] for c in curve], [c[1] for c in curve], styles.get(settings["policy"], "-"),
                label=f"{settings['policy']} {_size(result) or 'full'} (ppl {result['ppl']:.2f})")
    ax.set_xlabel("tokens")
    ax.set_ylabel("running perplexity")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as partial:
        fig.savefig(partial, dpi=120)
    plt.close(fig)


def summary_table(results: list[dict]) -> str:
    rows = [("policy", "split", "cache", "tokens", "ppl", "tok/s", "peak RSS")]
    for r in results:
        s = r["settings"]
        split = " ".join(f"{k}={s[k]}" for k in ("sinks", "heavy", "recent") if k in s)
        rows.append((s["policy"], split or "-", str(_size(r) or "-"), f"{r['tokens_fed']:,}", f"{r['ppl']:.3f}",
                     f"{r['tokens_per_second']:.0f}", f"{r['peak_rss_bytes'] / 2**20:.0f} MiB"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _size(result: dict) -> int | None:
    s = result["settings"]
    parts = [s[k] for k in ("sinks", "heavy", "recent") if k in s]
    return sum(parts) if parts else None
