"""Result files: the PPL-vs-tokens plot and the summary table (JSON goes through h2o_stream.files).

Reports cover every run result in the output directory (`results_in`), not only the runs of the latest call. The budget
split of a result is read from its settings by its policy's declared parts, so a new policy needs nothing here; each
policy gets its own line style in the order the policies first appear.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

from h2o_stream.engine.policies import policy_class
from h2o_stream.errors import H2OStreamError
from h2o_stream.files import atomic_path, is_partial, write_json  # noqa: F401  (write_json re-exported for callers)

from .schema import read_result

LINE_STYLES = ("-", "--", ":", "-.")


#: files written beside the run results in a directory (reports over them: `ppl`'s, `leaderboard`'s and the long-run
#: report of `python -m eval long report`), never read as results, so that more runs can join a reported folder
REPORT_FILES = ("summary.json", "leaderboard.json", "report.json")
#: what two runs must share for their perplexities to be compared: the same tokens (the corpus's text, the books read
#: and how much of each, where the stream starts, whether the cache empties at each book) through the same weights in
#: the same dtype and positions
STREAM_SETTINGS = ("model_weights", "dtype", "rolling", "skip_tokens", "books", "book_tokens", "reset_per_book")


def results_in(directory: str | os.PathLike) -> list[dict]:
    """Every run result in `directory` (its `*.json` files but the reports in REPORT_FILES), each checked against the
    result schema (`schema.read_result`), ordered by policy and cache size. A file that is not a valid result (a
    damaged or hand-edited one, a JSON file of the user's, a FIFO) is an H2OStreamError naming the file and the
    field: nothing is reported over, or written beside, files that cannot be trusted. A result still being written
    (`files.atomic_path`'s temporary name: another worker's, in the same folder) is not one yet and is skipped."""
    results = []
    for path in sorted(Path(directory).glob("*.json")):
        if path.name in REPORT_FILES or is_partial(path):
            continue
        results.append(read_result(path))  # the schema also refuses a policy this h2o-stream does not have
    return sorted(results, key=lambda r: (r["settings"]["policy"], cache_size(r) or 0))


def run_name(result: dict) -> str:
    """The run's name as `h2o-stream ppl` gives it, e.g. 'h2o-256' ('full' for a policy without parts), or
    'h2o-256-heavy=16' for a run of a part sweep (recorded in the result as `run`)."""
    size = cache_size(result)
    return result.get("run") or result["settings"]["policy"] + (f"-{size}" if size is not None else "")


def run_label(result: dict) -> str:
    """What a report calls the run beside its cache size: the policy, and a swept part's value when the run is one
    of a sweep ('h2o heavy=16')."""
    policy, size = result["settings"]["policy"], cache_size(result)
    swept = run_name(result).removeprefix(policy + (f"-{size}" if size is not None else ""))
    return " ".join([policy, *swept.split("-")[1:]])


def stream_difference(settings: dict, other: dict) -> str | None:
    """Why runs with these settings are not comparable (see STREAM_SETTINGS), or None when they are."""
    from .run import settings_difference

    def stream(s: dict) -> dict:
        # the corpus by its text where both runs know it (the same text at two paths is one corpus), else by name
        corpus = ("data_sha256",) if settings.get("data_sha256") and other.get("data_sha256") else ("data",)
        return {key: s.get(key) for key in (*STREAM_SETTINGS, *corpus)}

    mine, theirs = stream(settings), stream(other)
    return settings_difference(mine, theirs) if mine != theirs else None


def check_comparable(
    results: list[dict], directory: str | os.PathLike, settings: dict | None = None, against: str = ""
) -> None:
    """Refuse results in `directory` that were not run on one stream through one model (`stream_difference`): with
    `settings`, against those (the runs about to be made, named `against`); else against the first result. A report
    over them would rank perplexities of different texts or models side by side."""
    if not results:
        return
    if settings is None:
        settings, against = results[0]["settings"], f"{Path(directory) / run_name(results[0])}.json"
    for result in results:
        why = stream_difference(result["settings"], settings)
        if why:
            raise H2OStreamError(
                f"{Path(directory) / run_name(result)}.json and {against} were not run on the same "
                f"stream through the same model ({why}); a report ranks only runs that were: move "
                "the other runs away or choose another --out"
            )


def title_of(results: list[dict]) -> str:
    """'model · corpus' of the results (each distinct pair once)."""
    pairs = dict.fromkeys(f"{r['settings'].get('model')} · {r['settings'].get('data')}" for r in results)
    return " | ".join(pairs)


def plot_curves(results: list[dict], path: str | os.PathLike, title: str) -> None:
    """Running PPL vs tokens, one line per policy × cache size (H2O paper, Figure 5 style)."""
    fig, ax = pyplot().subplots(figsize=(8, 4.8), layout="constrained")
    policies = list(dict.fromkeys(r["settings"]["policy"] for r in results))
    for result in sorted(results, key=lambda r: (r["settings"]["policy"], cache_size(r) or 0)):
        curve = result["curve"]
        if not curve:
            continue
        policy = result["settings"]["policy"]
        ax.plot(
            [c[0] for c in curve],
            [c[1] for c in curve],
            LINE_STYLES[policies.index(policy) % len(LINE_STYLES)],
            label=f"{run_label(result)} {cache_size(result) or 'full'} (ppl {result['ppl']:.2f})",
        )
    ax.set_xlabel("tokens")
    ax.set_ylabel("running perplexity")
    title_figure(fig, title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def pyplot():
    """matplotlib.pyplot on its file-only backend (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def title_figure(fig, title: str, fontsize: float = 9) -> None:
    """`title` (the model and corpus: the user's words) above the whole figure, wrapped to its width and taken as
    plain text: a '$' in a path is a dollar sign, not the start of a formula (mathtext would fail on it)."""
    chars = max(20, int(fig.get_figwidth() * 72 / (0.65 * fontsize)))  # a character is ~0.5 em wide, plus margin
    fig.suptitle("\n".join(textwrap.wrap(title, width=chars)) or " ", fontsize=fontsize, parse_math=False, usetex=False)


def save_figure(fig, path: str | os.PathLike) -> None:
    """Write `fig` to `path` as a PNG, whole or not at all, and free it. Figures use the constrained layout, which
    keeps their titles and labels inside the image."""
    with atomic_path(path) as partial:
        fig.savefig(partial, dpi=120)
    pyplot().close(fig)


def summary_table(results: list[dict]) -> str:
    """One row per result: policy, split, cache size, tokens, PPL, speed, peak RSS."""
    rows = [("policy", "split", "cache", "tokens", "ppl", "tok/s", "peak RSS")]
    for r in results:
        split = " ".join(f"{k}={v}" for k, v in budget_split(r).items())
        rows.append(
            (
                r["settings"]["policy"],
                split or "-",
                str(cache_size(r) or "-"),
                f"{r['tokens_fed']:,}",
                f"{r['ppl']:.3f}",
                f"{r['tokens_per_second']:.0f}",
                f"{r['peak_rss_bytes'] / 2**20:.0f} MiB",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def budget_split(result: dict) -> dict[str, int]:
    """The result's budget parts as its policy declares them, e.g. {'heavy': 128, 'recent': 128}; {} for full."""
    settings = result["settings"]
    return {name: settings[name] for name in policy_class(settings["policy"]).part_names()}


def cache_size(result: dict) -> int | None:
    """The result's cache size (the sum of its parts); None for a policy without parts (full)."""
    split = budget_split(result)
    return sum(split.values()) if split else None
