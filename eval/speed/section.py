"""The speed section of the results page: every file `python -m eval speed` and its parts wrote, as ratios to the
raw twin."""

from __future__ import annotations

from pathlib import Path

from eval.page import Results, num, source, table


def decode_files(res: Results) -> list[str]:
    return sorted(
        res.names("speed/decode_*.json"), key=lambda n: (res.get(n) or {}).get("environment", {}).get("threads", 0)
    )


def speed_section(res: Results, page: Path) -> list[str]:
    lines = [
        "## Speed",
        "",
        "Every ratio is ours against the raw twin doing the same work, measured side by side in "
        "one process in alternating rounds (docs/benchmarks.md). Speed ratios: tokens/s ours ÷ tokens/s raw "
        "(1.00 = as fast).",
        "",
    ]
    for name in decode_files(res):
        r = res.get(name)
        med, plain, like = r["median_seconds_per_token"], r["ratio_vs_dynamic"], r["ratio_vs_dynamic_inference"]
        lines += [f"### Decode, {r['environment']['threads']} thread(s), cache {r['cache_size']}", ""]
        lines += table(
            ["contender", "ms per token (median)", "speed vs raw step", "vs raw step, inference mode"],
            [
                [
                    n,
                    num(1000 * med[n]),
                    num(1 / plain[n], 3) if n in plain else "1.000",
                    num(1 / like[n], 3) if n in like else "–",
                ]
                for n in med
            ],
            {1, 2, 3},
        )
        lines += [source(res, name, extra=f"; {r['rounds']} rounds of {r['block']} steps")]
        lines += [""] + res.figure(name.replace(".json", ".png"), page, "decode vs the raw step")
    scan = res.get("speed/exact_scan.json")
    if scan:
        counts = list(scan["threads"])
        names = list(scan["threads"][counts[0]]["tokens_per_second"])
        lines += [f"### Exact mode scanned, compiled and on tensor operations, cache {scan['cache_size']}", ""]
        lines += table(
            ["contender", *(f"{c} thread(s): {k}" for c in counts for k in ("tok/s", "vs raw forward"))],
            [
                [
                    n,
                    *(
                        v
                        for c in counts
                        for v in (
                            num(scan["threads"][c]["tokens_per_second"].get(n), 1),
                            num(scan["threads"][c]["vs_raw_forward"].get(n), 3),
                        )
                    ),
                ]
                for n in names
            ],
            set(range(1, 2 * len(counts) + 1)),
        )
        lines += [source(res, "speed/exact_scan.json"), ""] + res.figure("speed/exact_scan.png", page, "scan")
    # the committed table (speed/), then the same measurement at other thread counts (speed/*/)
    for name in (*res.names("speed/fair_chunks_*.json"), *res.names("speed/*/fair_chunks_*.json")):
        r = res.get(name)
        label = name.removeprefix("speed/").removesuffix(".json")
        lines += [
            f"### Fair chunks vs their raw twin (`{label}`), {r['environment']['threads']} thread(s)",
            "",
        ]
        lines += table(
            ["policy", "chunk", "raw twin", "tok/s", "raw tok/s", "speed vs raw", "vs raw, inference mode"],
            [
                [
                    p,
                    t["chunk_size"],
                    t["raw_forward"],
                    num(t["tokens_per_second"], 1),
                    num(t["raw_tokens_per_second"], 1),
                    num(t["ratio_vs_raw_forward"], 3),
                    num(t.get("ratio_vs_raw_forward_in_inference_mode"), 3),
                ]
                for p, t in r["throughput"].items()
            ],
            {1, 3, 4, 5, 6},
        )
        how = r.get("throughput_measured_with", {})
        lines += [
            source(
                res, name, extra=f"; {how.get('rounds')} rounds of {how.get('round_tokens')} tokens, forward by forward"
            ),
            "",
        ]
        lines += res.figure(name.replace(".json", ".png"), page, "fair chunks vs raw twin")
    rows = res.get("speed/rows.json")
    if rows:
        lines += [
            f"### A sweep as rows of one batch ({', '.join(rows['policies'])}, cache {rows['cache_size']}, "
            f"{rows['tokens_per_run']:,} tokens each)",
            "",
        ]
        lines += table(
            ["threads", "rows tok/s", "one after another tok/s", "rows ÷ one after another"],
            [
                [c, num(s["rows"], 0), num(s["one after another"], 0), num(rows["rows_vs_one_after_another"][c], 3)]
                for c, s in rows["sweep_tokens_per_second"].items()
            ],
            {0, 1, 2, 3},
        )
        worst = max(rows["mean_abs_token_nll_difference"].values(), default=0)
        lines += [
            f"Largest mean per-token NLL difference, rows against alone: {worst:.1e}.",
            "",
            source(res, "speed/rows.json"),
            "",
        ] + res.figure("speed/rows.png", page, "rows")
    start = res.get("speed/startup.json")
    if start:
        lines += [f"### CLI start-up, {start['rounds']} rounds", ""]
        if "cpus" in start:
            lines += [
                f"Fresh processes, launch to exit, on {start['cpus']} cores with a load average of "
                f"{num(start['load_average_at_start'][0], 1)} at the start (other work shared the machine).",
                "",
            ]
        lines += table(
            ["command", "median s", "max s", "exit status"],
            [
                [f"`{c}`", num(r["median_seconds"], 3), num(r["max_seconds"], 3), r["exit_status"]]
                for c, r in start["commands"].items()
            ],
            {1, 2, 3},
        )
        lines += [source(res, "speed/startup.json"), ""] + res.figure("speed/startup.png", page, "CLI start-up")
    return lines
