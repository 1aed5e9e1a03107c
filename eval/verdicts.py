"""README blocks that judge the leaderboards in words: each model's million-token runs against sinks, and whether a
policy meets the target of beating sinks, with the attention measurements that bear on why (eval/render.py)."""

from __future__ import annotations

from eval.long.boards import boards, model_of
from eval.page import Results, num, pct, source

#: the 1M-token fair-chunk runs, one folder per model (each has sink and others at cache 256)
LONG_BY_MODEL = ("long_fair", "long_fair_gemma3")
#: what a policy must reach at every cache size, on at least one model: PPL at most this fraction of sinks'
TARGET = 0.97


def short_name(model: str) -> str:
    return model.split(" (")[0]


def long_runs(res: Results, size: int) -> list[tuple[str, str, dict, dict]]:
    """(folder, model, report, {run: its comparison with sinks}) for each long-run report with runs at `size`."""
    found = []
    for folder in LONG_BY_MODEL:
        report = res.get(f"{folder}/report.json")
        runs = {n: c for n, c in (report or {}).get("vs_sink", {}).items() if n.endswith(f"-{size}")}
        if runs:
            model = report["runs"][next(iter(runs))].get("model") or "unnamed model"
            found.append((folder, short_name(model), report, runs))
    return found


def long_by_model(res: Results, size: int = 256) -> list[str]:
    """In words, per model with a long-run report: each policy at cache `size` against sinks over the whole run
    (its PPL ratio and the windows in which it was lower than sinks), followed by a blank line; nothing if no report
    has such runs."""
    said, sources = [], []
    for folder, model, report, runs in long_runs(res, size):
        first = next(iter(runs.values()))
        ranked = sorted(runs.items(), key=lambda item: item[1]["ppl_ratio"])
        windows = f" windows of {report['window']:,} tokens lower than sinks"
        others = ", ".join(
            f"{name.rsplit('-', 1)[0]} {pct(cmp['ppl_ratio'] - 1)} ({cmp['windows_lower_than_sink']} of "
            f"{cmp['windows_compared']}{windows if i == 0 else ''})"
            for i, (name, cmp) in enumerate(ranked)
        )
        tokens = first["predicted_tokens"] + 1
        said.append(f"on {model} over {tokens:,} tokens, sinks {num(first['sink_ppl'])}; {others}")
        sources.append(source(res, f"{folder}/report.json"))
    if not said:
        return []
    return [f"**Over a million tokens at cache {size}:** " + "; ".join(said) + ".", ""] + [
        line for text in sources for line in (text, "")
    ]


def best_other(rows: list[dict]) -> tuple[str, float] | None:
    """(policy, its PPL ÷ sink's) of the lowest-PPL policy other than sink among a board size's rows, or None."""
    sink = next((r["ppl"] for r in rows if r["policy"] == "sink"), None)
    others = [r for r in rows if r["policy"] != "sink"]
    if sink is None or not others:
        return None
    best = min(others, key=lambda r: r["ppl"])
    return best["policy"], best["ppl"] / sink


def target(res: Results) -> list[str]:
    """Whether some policy beats sinks by the target at every cache size on some model (the boards, and the
    million-token runs where there are some); if none does, by how much the best falls short; then where the
    models' attention goes (models/attention_by_distance.json)."""
    found = boards(res)
    if not found:
        return []
    said, met, ratios = [], [], []
    for _, board in found:
        places = {size: best_other(board["sizes"][size]["rows"]) for size in sorted(board["sizes"], key=int)}
        places = {size: place for size, place in places.items() if place}
        ratios += [ratio for _, ratio in places.values()]
        if not places:
            continue
        tokens = sorted({r["tokens"] for s in board["sizes"].values() for r in s["rows"]})
        model = short_name(model_of(board))
        best = ", ".join(f"{policy} {pct(ratio - 1)} at {size}" for size, (policy, ratio) in places.items())
        short = [100 * (ratio - TARGET) for _, ratio in places.values()]
        if max(short) <= 0:
            met.append(model)
        gap = f", {num(min(short), 1)} to {num(max(short), 1)} points short" if max(short) > 0 else ""
        said.append(
            f"on {model} ({', '.join(f'{t:,}' for t in tokens)} predicted tokens) the best other policy is {best}{gap}"
        )
    for _, model, _, runs in long_runs(res, 256):
        name, cmp = min(runs.items(), key=lambda item: item[1]["ppl_ratio"])
        tokens = cmp["predicted_tokens"] + 1
        said.append(f"over {tokens:,} tokens at 256 on {model}, {name.rsplit('-', 1)[0]} {pct(cmp['ppl_ratio'] - 1)}")
    beaten = sum(ratio < 1 for ratio in ratios)
    if met:
        verdict = f"met on {', '.join(met)}"
    elif beaten:
        verdict = f"not met: a policy beats sinks at {beaten} of the boards' sizes, but not by the target"
    else:
        verdict = "not met: no policy beats sinks at any cache size on any model"
    lines = [
        f"**Target: a policy at least {pct(TARGET - 1).lstrip('-')} better than sinks at every cache size over a "
        f"million tokens, on at least one model.** So far {verdict}; " + "; ".join(said) + "."
    ]
    attention = res.get("models/attention_by_distance.json")
    if attention:
        shares = "; ".join(
            f"{short_name(model)} {num(100 * (m['mean']['sinks'] + m['mean']['recent']), 1)}% and "
            f"{num(100 * m['mean']['older'], 1)}%"
            for model, m in attention["models"].items()
        )
        lines[0] += (
            f" Where the attention goes bears on why: over windows of {attention['length']:,} tokens of the models' "
            f"own forward (the mean over layers), the first {attention['sinks']} keys and the last "
            f"{attention['recent']} (what sinks keep at cache {attention['sinks'] + attention['recent']}) take most "
            "of the attention and the older keys "
            f"between them the rest ({shares}); those older keys are the only ones a heavy-hitter policy can add, "
            "and each it keeps costs a recent slot."
        )
        lines += ["", source(res, "models/attention_by_distance.json")]
    return lines
