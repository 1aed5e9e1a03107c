"""serve: `h2o-stream serve` under load, on the default model.

16 conversations talk to one server at once, 20 turns each, through the official `openai` client, streaming; the
server keeps fewer idle conversations in memory than there are (--in-memory 8 of 16), so turns keep loading their
conversation from its session file; up to --max-batch turns run at once, their forwards batched (--no-batching: one
by one). Each client resends its whole history every turn, as OpenAI clients do.
Recorded: every request's time to first token (from sending it to the first text chunk: queueing, reading the new
message, the first token), its reply tokens and time; the server's resident memory sampled every half second; the
tokens the server fed for each turn (the new message only, when the conversation was recognised). Pass criteria: no
failed request, every turn after the first of its conversation recognised (nothing but the new message fed), and RSS
flat: the largest RSS after warm-up (once every conversation's cache holds its whole budget) <= 1.1 x the RSS at
warm-up's end.
User messages are fixed short questions (no corpus); replies are sampled with the chat's settings, seeded per
conversation, and kept short (--max-tokens) so that the run takes about ten minutes on 2 cores.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import click

from eval.common import RESULTS, BadInput, environment, model_option, new_figure, relative, save_figure, write_result
from eval.page import num, source, table

QUESTIONS = [
    "What is a good name for a cat?",
    "Tell me a fact about the sea.",
    "Why is the sky blue?",
    "Give me one tip for sleeping well.",
    "What is two plus two?",
    "Name a fruit that is red.",
    "What do bees make?",
    "How many days are in a week?",
    "Suggest a short poem title.",
    "What is the capital of France?",
    "Say hello in Spanish.",
    "What is rain made of?",
    "Name an animal that can fly.",
    "What colour are leaves in summer?",
    "Why do we need water?",
    "What is a comet?",
    "Recommend a board game.",
    "What is the opposite of cold?",
    "Describe the moon in five words.",
    "What does a baker do?",
]


@click.command()
@model_option
@click.option("--conversations", default=16, show_default=True)
@click.option("--turns", default=20, show_default=True)
@click.option(
    "--in-memory", default=8, show_default=True, help="The server's --in-memory (fewer than --conversations)."
)
@click.option("--max-batch", default=16, show_default=True, help="The server's --max-batch: turns under way at once.")
@click.option("--cache-size", default=256, show_default=True)
@click.option("--max-tokens", default=16, show_default=True, help="Reply length limit per turn.")
@click.option("--threads", default=2, show_default=True, help="The server's torch threads.")
@click.option(
    "--batching/--no-batching",
    default=True,
    show_default=True,
    help="The server's batching of the turns under way (--no-batching: its forwards one by one, to compare).",
)
@click.option(
    "--out", type=click.Path(dir_okay=False, path_type=Path), default=RESULTS / "serve" / "load.json", show_default=True
)
def serve(model_spec, conversations, turns, in_memory, max_batch, cache_size, max_tokens, threads, batching, out):
    """16 conversations x 20 turns against one `h2o-stream serve`: failures, time to first token, tokens/s, RSS."""
    if in_memory >= conversations:
        raise BadInput(
            f"--in-memory ({in_memory}) must be smaller than --conversations ({conversations}): the run "
            "measures conversations going to disk and back"
        )
    if min(conversations, turns, in_memory, max_batch, max_tokens, threads) < 1:
        raise BadInput("--conversations, --turns, --in-memory, --max-batch, --max-tokens and --threads must be >= 1")
    with tempfile.TemporaryDirectory(prefix="h2o-stream-serve-load-") as state:
        process, url = _start(model_spec, state, in_memory, max_batch, cache_size, threads, batching)
        try:
            result = _load(process, url, conversations, turns, max_tokens, cache_size)
        finally:
            process.terminate()
            process.wait(timeout=60)
    result["settings"] = {
        "model": relative(model_spec) if model_spec else "SmolLM2-135M-Instruct (default)",
        "conversations": conversations,
        "turns": turns,
        "in_memory": in_memory,
        "max_batch": max_batch,
        "cache_size": cache_size,
        "policy": "h2o",
        "max_tokens": max_tokens,
        "server_threads": threads,
        "batching": batching,
    }
    result["environment"] = environment()
    write_result(out, result, plot)


def _start(model_spec, state: str, in_memory: int, max_batch: int, cache_size: int, threads: int, batching: bool):
    command = [
        sys.executable,
        "-m",
        "h2o_stream",
        "serve",
        "--port",
        "0",
        "--state-dir",
        state,
        "--in-memory",
        str(in_memory),
        "--max-batch",
        str(max_batch),
        "--cache-size",
        str(cache_size),
        "--threads",
        str(threads),
        "--log-level",
        "warning",
        "--model-name",
        "model",
        *([] if batching else ["--no-batching"]),
    ]
    return start_server(command + (["--model", model_spec] if model_spec else []))


def start_server(command: list[str], **popen) -> tuple[subprocess.Popen, str]:
    """Run an `h2o-stream serve` command line; the process and its base URL, read from its start line (BadInput,
    with its last lines, if it exits first). Its stderr goes on being read, so that it never blocks on a full pipe."""
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, **popen)
    seen = []
    for line in process.stderr:
        seen.append(line)
        found = re.search(r"at (http://\S+/v1)", line)
        if found:
            threading.Thread(target=lambda: [seen.append(x) for x in process.stderr], daemon=True).start()
            return process, found[1]
    process.wait()
    raise BadInput("the server did not start:\n" + "".join(seen[-20:]))


def _load(process, url: str, conversations: int, turns: int, max_tokens: int, budget: int) -> dict:
    import openai
    import psutil

    server = psutil.Process(process.pid)
    rss, stop = [], threading.Event()
    started = time.perf_counter()

    def sample():
        while not stop.is_set():
            rss.append((time.perf_counter() - started, server.memory_info().rss))
            stop.wait(0.5)

    requests, failures, lock = [], [], threading.Lock()

    def talk(k: int):
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
        messages = [{"role": "system", "content": f"You are assistant number {k}. Answer briefly."}]
        for turn in range(turns):
            messages.append({"role": "user", "content": QUESTIONS[(k + turn) % len(QUESTIONS)]})
            sent = time.perf_counter()
            first, text, info, usage = None, "", None, None
            try:
                stream = client.chat.completions.create(
                    model="model",
                    messages=messages,
                    stream=True,
                    max_tokens=max_tokens,
                    seed=k,
                    stream_options={"include_usage": True},
                )
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        first = first or time.perf_counter()
                        text += chunk.choices[0].delta.content
                    info = chunk.model_extra.get("h2o_stream") or info
                    usage = chunk.usage or usage
            except Exception as error:  # noqa: BLE001 - every failure is counted and recorded, the run goes on
                with lock:
                    failures.append({"conversation": k, "turn": turn, "error": f"{type(error).__name__}: {error}"})
                return
            done = time.perf_counter()
            messages.append({"role": "assistant", "content": text})
            with lock:
                requests.append(
                    {
                        "conversation": k,
                        "turn": turn,
                        "sent": sent - started,
                        "ttft": (first or done) - sent,
                        "seconds": done - sent,
                        "completion_tokens": usage.completion_tokens,
                        "cached_tokens": usage.prompt_tokens_details.cached_tokens,
                        "fed_tokens": info["fed_tokens"],
                        "how": info["how"],
                        "replayed_turns": info["replayed_turns"],
                        "cache_slots": info["cache_slots"],
                    }
                )

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    clients = [threading.Thread(target=talk, args=(k,)) for k in range(conversations)]
    for client in clients:
        client.start()
    for client in clients:
        client.join()
    wall = time.perf_counter() - started
    stop.set()
    sampler.join()
    return summarize(requests, failures, rss, wall, conversations, turns, budget)


def summarize(
    requests: list[dict], failures: list[dict], rss: list, wall: float, conversations: int, turns: int, budget: int
) -> dict:
    """The run's figures and pass criteria from its requests and RSS samples."""
    if not requests:
        raise BadInput(f"no request succeeded: {failures[:3]}")
    ttft = sorted(r["ttft"] for r in requests)
    tokens = sum(r["completion_tokens"] for r in requests)
    later = [r for r in requests if r["turn"] > 0]
    warm, rule = _warm_up(requests, budget)
    at_warm = next((v for t, v in rss if t >= warm), rss[-1][1])
    after = [v for t, v in rss if t >= warm] or [at_warm]
    # for comparison: from when every conversation finished its second turn (caches still filling)
    second = max((r["sent"] + r["seconds"] for r in requests if r["turn"] == min(1, turns - 1)), default=0.0)
    at_second = next((v for t, v in rss if t >= second), rss[-1][1])
    return {
        "requests": len(requests),
        "expected_requests": conversations * turns,
        "failed": len(failures),
        "failures": failures,
        "ttft_seconds": {"p50": _quantile(ttft, 0.5), "p95": _quantile(ttft, 0.95), "max": ttft[-1]},
        "tokens_per_second": tokens / wall,
        "completion_tokens": tokens,
        "wall_seconds": wall,
        "per_request_tokens_per_second_median": statistics.median(
            r["completion_tokens"] / r["seconds"] for r in requests if r["seconds"] > 0
        ),
        "recognised": sum(r["how"] == "continued" and r["replayed_turns"] == 0 for r in later),
        "later_turns": len(later),
        "fed_tokens_later_turns_median": statistics.median(r["fed_tokens"] for r in later) if later else 0,
        "rss": {
            "warm_up_seconds": warm,
            "warm_up_ends": rule,
            "at_warm_up_bytes": at_warm,
            "max_after_warm_up_bytes": max(after),
            "ratio": max(after) / at_warm,
            "first_bytes": rss[0][1],
            "last_bytes": rss[-1][1],
            "at_second_turns_bytes": at_second,
            "ratio_after_second_turns": max([v for t, v in rss if t >= second] or [at_second]) / at_second,
        },
        "passed": {
            "no_failed_request": not failures and len(requests) == conversations * turns,
            "every_later_turn_recognised": all(r["how"] == "continued" and r["replayed_turns"] == 0 for r in later),
            "rss_flat": max(after) <= 1.1 * at_warm,
        },
        "rss_samples": [[round(t, 2), v] for t, v in rss],
        "per_request": sorted(requests, key=lambda r: r["sent"]),
    }


def _warm_up(requests: list[dict], budget: int) -> tuple[float, str]:
    """When warm-up ends: once every conversation's cache holds its whole budget (from then on no conversation's
    memory can grow), or, if some never fill, once every conversation has finished its second turn."""
    full: dict[int, float] = {}
    for r in sorted(requests, key=lambda r: r["sent"] + r["seconds"]):
        if r["cache_slots"] >= budget:
            full.setdefault(r["conversation"], r["sent"] + r["seconds"])
    if len(full) == len({r["conversation"] for r in requests}):
        return max(full.values()), "every cache full"
    return max((r["sent"] + r["seconds"] for r in requests if r["turn"] == 1), default=0.0), "every second turn done"


def _quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1] if len(values) > 1 else values[0]


def plot(result: dict, path) -> None:
    fig, (ax_rss, ax_ttft) = new_figure(1, 2, size=(11, 3.8))
    samples = result["rss_samples"]
    ax_rss.plot([t for t, _ in samples], [v / 2**20 for _, v in samples], lw=1.2, label="server RSS")
    ax_rss.axvline(result["rss"]["warm_up_seconds"], color="grey", ls=":", label="warm-up ends")
    ax_rss.axhline(
        1.1 * result["rss"]["at_warm_up_bytes"] / 2**20, color="#c44e52", ls="--", lw=0.8, label="1.1 x RSS at warm-up"
    )
    ax_rss.set_xlabel("seconds")
    ax_rss.set_ylabel("MiB")
    ax_rss.legend(fontsize=7)
    requests = result["per_request"]
    ax_ttft.scatter([r["sent"] for r in requests], [r["ttft"] for r in requests], s=6, alpha=0.6)
    for q, style in (("p50", "-"), ("p95", "--")):
        ax_ttft.axhline(result["ttft_seconds"][q], color="grey", ls=style, lw=0.8, label=q)
    ax_ttft.set_xlabel("request sent at (seconds)")
    ax_ttft.set_ylabel("time to first token (s)")
    ax_ttft.legend(fontsize=7)
    s = result["settings"]
    save_figure(
        fig,
        path,
        f"h2o-stream serve: {s['conversations']} conversations x {s['turns']} turns, "
        f"{s['in_memory']} in memory, cache {s['cache_size']}, {s['server_threads']} threads; "
        f"{result['tokens_per_second']:.1f} tok/s overall, RSS x{result['rss']['ratio']:.3f}",
    )


#: the committed runs the results page shows side by side, in this order (those present)
RUNS = ("serve/load.json", "serve/load_unbatched.json", "serve/load_32.json")


def _title(result: dict, first: dict) -> str:
    """A run's column: batched or not, and its conversations where they differ from the first run's."""
    settings = result["settings"]
    title = "batched" if settings["batching"] else "one forward at a time"
    if settings["conversations"] != first["settings"]["conversations"]:
        title += f", {settings['conversations']} conversations"
    return title


def serve_section(res, page) -> list[str]:
    """docs/results.md's section for the runs of `RUNS` (called by eval.results_page), side by side."""
    found = [(path, res.get(path)) for path in RUNS if res.get(path)]
    if not found:
        return []
    runs = [(path, _title(result, found[0][1]), result) for path, result in found]
    s = runs[0][2]["settings"]
    intro = (
        f"{s['conversations']} conversations × {s['turns']} turns against one `h2o-stream serve` ({s['policy']} "
        f"cache {s['cache_size']}, {s['in_memory']} idle conversations in memory, at most "
        f"{s['max_batch']} turns under way, {s['server_threads']} server threads, replies of at "
        f"most {s['max_tokens']} tokens), streamed through the openai client; a column per run, its settings in "
        "its title where they differ. Batched, the forwards of every turn under way run as the rows of one batch; "
        "one forward at a time is the server with `--no-batching`. Time to first token is mostly waiting for a "
        "turn slot."
    )

    def row(name: str, cell) -> list[str]:
        return [name, *(cell(result) for _, _, result in runs)]

    def rss_cell(r: dict) -> str:
        rss = r["rss"]
        return (
            f"{rss['at_warm_up_bytes'] / 2**20:,.1f} → {rss['max_after_warm_up_bytes'] / 2**20:,.1f} MiB "
            f"({num(rss['ratio'], 3)}×)"
        )

    def ttft_cell(r: dict) -> str:
        t = r["ttft_seconds"]
        return f"{num(t['p50'])} / {num(t['p95'])} / {num(t['max'])} s"

    def second_turns(r: dict) -> str:
        rss = r["rss"]
        return f"{rss['at_second_turns_bytes'] / 2**20:,.1f} MiB ({num(rss['ratio_after_second_turns'], 3)}×)"

    def recognised(r: dict) -> str:
        return f"{r['recognised']} of {r['later_turns']}"

    def one_request(r: dict) -> str:
        return num(r["per_request_tokens_per_second_median"])

    def passed_cell(r: dict) -> str:
        return ", ".join(f"{name.replace('_', ' ')}: {'yes' if ok else 'NO'}" for name, ok in r["passed"].items())

    lines = ["## Serve under load", "", intro, ""]
    lines += table(
        ["measure", *(title for _, title, _ in runs)],
        [
            row("requests (failed)", lambda r: f"{r['requests']} of {r['expected_requests']} ({r['failed']})"),
            row(
                "later turns recognised (only the new message fed)",
                lambda r: f"{r['recognised']} of {r['later_turns']}",
            ),
            row("tokens fed per later turn, median", lambda r: num(r["fed_tokens_later_turns_median"], 0)),
            row("time to first token p50 / p95 / max", ttft_cell),
            row("reply tokens per second, all conversations together", lambda r: num(r["tokens_per_second"])),
            row(
                "reply tokens per second of one request, median",
                lambda r: num(r["per_request_tokens_per_second_median"]),
            ),
            row("server RSS at warm-up → largest after", rss_cell),
            row("warm-up ends", lambda r: f"{r['rss']['warm_up_ends']}, at {num(r['rss']['warm_up_seconds'], 0)} s"),
            row("server RSS once every second turn is done → largest after (caches still filling)", second_turns),
            row("wall time", lambda r: f"{num(r['wall_seconds'], 0)} s"),
            row("pass", passed_cell),
        ],
        set(range(1, len(runs) + 1)),
    )
    lines += [" ".join(source(res, path) for path, _, _ in runs), ""]
    for path, title, _ in runs:
        lines += res.figure(path.replace(".json", ".png"), page, f"serve under load, {title}")
    return lines
