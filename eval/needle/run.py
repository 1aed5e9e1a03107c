"""Passkey (needle) retrieval through a fixed-size KV cache: what does the model keep from far back?

A random five-digit passkey sentence ("The secret passkey is 48213. Remember it.") is inserted at a chosen depth into
Gutenberg filler text (from `--data`) of 4x-64x the cache size; the model reads the document through the cache and is
then asked "What is the secret passkey?" with the answer primed ("The secret passkey is"); it decodes a few tokens
greedily and a cell scores 1 if the first number it writes is the passkey, digit for digit.

Variants, all with the same budget of B KV entries per layer and KV head:
- every registered policy: the whole document streams through the cache, in fair chunks of the policy's default
  size (`default_chunk_size`) unless --chunk-size is given;
- truncation: the model only ever sees the last tokens: prompt + the document's last tokens + question = B tokens
  (a fresh cache, nothing evicted before the question; `window` B during the few generated tokens);
- full (optional, reference): no eviction, only where the document fits in the model's context.

Cost saving: the cells of one (variant, trial) share reads: the filler is read once; at each needle position a copy of
the cache reads the needle and the filler after it, and at each document end a copy of that reads the question. So a
cell's chunks are `chunk` tokens at multiples of `chunk` of the tokens its cache has read, cut short at branch points
(read in scanned forwards of up to 256 tokens, `StreamingCache(decide_every=chunk)`: the same decisions, faster).
The prompt is summarize's (`h2o_stream.apps.summarize.build_prompt`): chat template, document in the user turn,
question last. Reading is the engine's `feed`; answering is `h2o_stream.generation.generate` (greedy).
"""

from __future__ import annotations

import itertools
import platform
import random
import re
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import click
import torch

from eval.common import (
    RESULTS,
    BadInput,
    command_line,
    corpus_record,
    data_option,
    load_model,
    relative,
    retrieval_heads_option,
    suite_policy,
)
from eval.needle.report import accuracy_grid, heatmap, table
from h2o_stream import StreamingCache, make_policy
from h2o_stream.apps.perplexity.stream import default_span
from h2o_stream.apps.summarize import build_prompt, encode
from h2o_stream.engine import POLICIES, default_chunk_size
from h2o_stream.engine.feed import feed
from h2o_stream.files import write_json
from h2o_stream.generation import Sampling, generate, stop_token_ids
from h2o_stream.loading.corpus import describe_source, read_book

NEEDLE = "The secret passkey is {key}. Remember it."
QUESTION = "What is the secret passkey?"
PRIMER = "The secret passkey is"
VARIANTS = (*POLICIES, "truncation")


@click.command()
@click.option("--model", default=None, help="Model to load (default: SmolLM2-135M-Instruct).")
@click.option("--cache-size", default=256, show_default=True)
@click.option(
    "--chunk-size",
    type=int,
    default=None,
    help="Tokens per forward (default: each policy's default_chunk_size; truncation: 128).",
)
@click.option("--lengths", default="1024,2048", show_default=True, help="Filler lengths in tokens.")
@click.option("--depths", default="0,0.25,0.5,0.75,1", show_default=True, help="Needle depths, 0 = start, 1 = end.")
@click.option(
    "--policies",
    default="h2o,sink,window,tova,a2sf,h2o_sinks,sepllm,keydiff,roco,truncation",
    show_default=True,
    help=f"Any of {','.join(VARIANTS)}.",
)
@retrieval_heads_option
@click.option("--trials", default=3, show_default=True)
@click.option(
    "--books",
    default="Pride and Prejudice,The Adventures of Sherlock Holmes",
    show_default=True,
    help="Filler book per trial (titles, or parts of titles, from --data; cycled).",
)
@click.option("--seed", default=1919, show_default=True)
@click.option("--new-tokens", default=8, show_default=True)
@click.option(
    "--threads",
    default=1,
    show_default=True,
    help="Torch threads (on a busy 2-core machine 2 threads ran 5-15x slower than 1).",
)
@click.option(
    "--budget-minutes",
    type=float,
    default=None,
    help="Start another trial only if it should finish within this many minutes in all.",
)
@data_option
@click.option(
    "--out", default=str(RESULTS / "needle" / "policies"), show_default=True, help="Writes OUT.json and OUT.png."
)
@click.option("--no-write", is_flag=True, help="Print the table only.")
def needle(**params) -> None:
    """Passkey retrieval through the cache, every policy: needle/policies.json (+ heat maps)."""
    main(SimpleNamespace(**params, out_path=Path(params["out"])))


# --- the haystack ------------------------------------------------------------------------------------------------


def make_trial(tokenizer, data: str, title: str, rng: random.Random, max_tokens: int) -> dict:
    """Filler token ids made of whole sentences, the sentence boundaries (token offsets), and a passkey."""
    _, chosen = read_book(data, title)
    title, book = chosen.title, chosen.text
    start = int(len(book) * rng.uniform(0.1, 0.4))
    text = " ".join(book[start : start + max_tokens * 7].split())  # ~4 characters a token: plenty
    sentences = re.split(r"(?<=[.!?])\s+", text)[1:]  # drop the first, probably cut mid-sentence
    pieces = tokenizer([" " + s for s in sentences], add_special_tokens=False).input_ids
    ids, boundaries = [], [0]
    for piece in pieces:
        if len(ids) >= max_tokens:
            break
        ids.extend(piece)
        boundaries.append(len(ids))
    if len(ids) < max_tokens:
        raise BadInput(f"{title!r} from offset {start} gives only {len(ids)} filler tokens, need {max_tokens}")
    return {
        "book": title,
        "char_offset": start,
        "passkey": rng.randint(10000, 99999),
        "filler": ids,
        "boundaries": boundaries,
    }


def place(boundaries: list[int], length: int, depth: float) -> tuple[int, int]:
    """(cut, needle position) in filler tokens: the document is filler[:cut] with the needle inserted at `ins`; both
    are the last sentence boundary at or before length and depth * length (so cells that share a needle position
    share their reads)."""
    cut = max(b for b in boundaries if b <= length)
    ins = max(b for b in boundaries if b <= depth * length)
    return cut, ins


def score(answer: str, passkey: int) -> int:
    match = re.search(r"\d+", answer)
    return int(match is not None and match.group() == str(passkey))


# --- runs --------------------------------------------------------------------------------------------------------


def reply(model, tokenizer, cache: StreamingCache, logits, new_tokens: int, stops: set[int]) -> str:
    """The model's greedy answer (at most `new_tokens` tokens) after the prompt in `cache`."""
    sampling = Sampling(temperature=0, max_new_tokens=new_tokens, seed=0)
    return generate(model, tokenizer, cache, logits, sampling, stop_ids=stops).text.strip()


def fork(model, policy, cache: StreamingCache) -> StreamingCache:
    copy = StreamingCache(model, policy, decide_every=cache.decide_every)
    copy.load_state(cache.state())  # state() copies the tensors
    return copy


def read_segments(model, cache, ids: list[int], stops: list[int], span: int, on_stop) -> None:
    """Feed `ids` in forwards of up to `span` tokens that also end at every position in `stops`; call
    on_stop(position) there."""
    stops = sorted(set(stops))
    if stops[0] == 0:
        on_stop(0)
    bounds = sorted(set(stops) | {0})
    for a, b in itertools.pairwise(bounds):
        feed(model, cache, torch.tensor([ids[a:b]]), span)
        if b in stops:
            on_stop(b)


def run_streamed(
    model, tokenizer, variant: str, trial: dict, cells: list[dict], args, prompt, needle_ids, stops: set[int]
) -> list:
    """All cells of one trial for a streamed variant, as a tree of shared reads: the filler is read once; at each
    needle position a branch (a copy of the cache) reads the needle and the filler after it; at each document end on
    that branch a copy reads the question and answers. Chunks are `chunk` tokens, cut short at branch points."""
    cache_size = None if variant == "full" else args.cache_size
    policy = suite_policy(variant, cache_size, tokenizer, args.retrieval_heads)
    filler, chunk = trial["filler"], args.chunk_size or default_chunk_size(policy)
    span = default_span(chunk)  # scanned forwards: decisions every `chunk` tokens, inside forwards of `span`
    context = model.config.max_position_embeddings
    out, runnable = [], []
    for cell in cells:
        total = len(prompt.prefix) + cell["cut"] + len(needle_ids) + len(prompt.suffix) + args.new_tokens
        if variant == "full" and total > context:
            out.append({**cell, "correct": None, "answer": None, "skipped": f"{total} tokens > context {context}"})
        else:
            runnable.append(cell)
    if not runnable:
        return out
    by_ins: dict[int, list[dict]] = {}
    for cell in runnable:
        by_ins.setdefault(cell["ins"], []).append(cell)

    def ask(branch, cell) -> None:
        began = time.perf_counter()
        cache = fork(model, policy, branch)
        logits = feed(model, cache, torch.tensor([prompt.suffix]), span)
        answer = reply(model, tokenizer, cache, logits, args.new_tokens, stops)
        out.append(
            {
                **cell,
                "answer": answer,
                "correct": score(answer, trial["passkey"]),
                "evicted": cache.evicted,
                "seconds_answer": round(time.perf_counter() - began, 2),
            }
        )
        print(
            f"  {variant:10s} trial {cell['trial']} len {cell['length']:6d} depth {cell['depth']:.2f}: "
            f"{'OK ' if out[-1]['correct'] else 'no '} {answer!r}",
            flush=True,
        )

    def branch_at(p: int) -> None:
        branch = fork(model, policy, base)
        ids = needle_ids + filler[p : max(c["cut"] for c in by_ins[p])]
        groups: dict[int, list[dict]] = {}
        for c in by_ins[p]:
            groups.setdefault(c["cut"] - p + len(needle_ids), []).append(c)
        read_segments(model, branch, ids, list(groups), span, lambda end: [ask(branch, c) for c in groups[end]])

    base = StreamingCache(model, policy, decide_every=chunk)
    feed(model, base, torch.tensor([prompt.prefix]), span)
    read_segments(model, base, filler, sorted(by_ins), span, branch_at)
    return out


def run_truncation(model, tokenizer, trial: dict, cells: list[dict], args, prompt, needle_ids, stops: set[int]) -> list:
    """The model sees the prompt, the document's last tokens and the question: B tokens in all."""
    policy = make_policy("window", args.cache_size)
    keep = args.cache_size - len(prompt.prefix) - len(prompt.suffix)
    if keep <= 0:
        raise BadInput(f"cache size {args.cache_size} leaves no room for the document after the prompt")
    out = []
    for cell in cells:
        filler, p, cut = trial["filler"], cell["ins"], cell["cut"]
        document = filler[:p] + needle_ids + filler[p:cut]
        tail = document[-keep:]
        cache = StreamingCache(model, policy)
        logits = feed(model, cache, torch.tensor([prompt.prefix + tail + prompt.suffix]), args.chunk_size or 128)
        answer = reply(model, tokenizer, cache, logits, args.new_tokens, stops)
        needle_seen = len(document) - p <= keep  # the whole needle sentence is in the tail
        out.append(
            {
                **cell,
                "answer": answer,
                "correct": score(answer, trial["passkey"]),
                "needle_in_input": needle_seen,
                "evicted": cache.evicted,
            }
        )
        print(
            f"  truncation trial {cell['trial']} len {cell['length']:6d} depth {cell['depth']:.2f}: "
            f"{'OK ' if out[-1]['correct'] else 'no '} {answer!r}",
            flush=True,
        )
    return out


def versions(model_name: str) -> dict:
    """Library versions, the commit and the machine a result was made with."""
    import transformers

    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
            ).stdout.strip()
            or None
        )
    except OSError:
        commit = None
    from importlib.metadata import version

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "h2o_stream": version("h2o-stream"),
        "git_commit": commit,
        "model": model_name,
        "platform": platform.platform(),
    }


def main(args) -> None:
    """Run every (trial, variant, length, depth) cell; write the result after each trial."""
    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    variants = [v.strip() for v in args.policies.split(",")]
    for v in variants:
        if v not in VARIANTS:
            raise click.BadParameter(
                f"unknown variant {v!r}: choose from {', '.join(VARIANTS)}", param_hint="--policies"
            )
    if "head_hybrid" in variants:  # a missing or bad classification fails before the model loads
        suite_policy("head_hybrid", args.cache_size, None, args.retrieval_heads)
    books = [b.strip() for b in args.books.split(",")]
    loaded = load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    prompt = build_prompt(tokenizer, QUESTION, response_prefix=PRIMER)
    rng = random.Random(args.seed)
    trials = [make_trial(tokenizer, args.data, books[t % len(books)], rng, max(lengths)) for t in range(args.trials)]
    stops = stop_token_ids(tokenizer, model)

    started = time.perf_counter()
    results, done_trials, stopped = [], 0, None
    for t, trial in enumerate(trials):  # trial-major, so a run cut short by --budget-minutes keeps whole trials
        if t > 0 and args.budget_minutes is not None:
            per_trial = (time.perf_counter() - started) / t
            if time.perf_counter() - started + per_trial > args.budget_minutes * 60:
                stopped = (
                    f"stopped after {t} trial(s): another would take ~{per_trial / 60:.0f} min more, "
                    f"beyond --budget-minutes {args.budget_minutes}"
                )
                print(stopped, flush=True)
                break
        needle_ids = encode(tokenizer, " " + NEEDLE.format(key=trial["passkey"]))
        for variant in variants:
            cells = []
            for length in lengths:
                for depth in depths:
                    cut, ins = place(trial["boundaries"], length, depth)
                    cells.append(
                        {
                            "variant": variant,
                            "trial": t,
                            "length": length,
                            "depth": depth,
                            "cut": cut,
                            "ins": ins,
                            "passkey": trial["passkey"],
                        }
                    )
            began = time.perf_counter()
            if variant == "truncation":
                results += run_truncation(model, tokenizer, trial, cells, args, prompt, needle_ids, stops)
            else:
                results += run_streamed(model, tokenizer, variant, trial, cells, args, prompt, needle_ids, stops)
            print(f"{variant} trial {t}: {time.perf_counter() - began:.0f} s", flush=True)
        done_trials = t + 1
        if not args.no_write:
            write(
                args,
                loaded.name,
                prompt,
                trials[:done_trials],
                variants,
                lengths,
                depths,
                results,
                time.perf_counter() - started,
                stopped,
            )

    elapsed = time.perf_counter() - started
    print()
    print(table(results, variants, lengths, depths, args.cache_size))
    print(f"{len(results)} cells, {done_trials} trial(s), in {elapsed:.0f} s")
    if not args.no_write:
        write(args, loaded.name, prompt, trials[:done_trials], variants, lengths, depths, results, elapsed, stopped)
        print(f"wrote {args.out_path.with_suffix('.json')} and {args.out_path.with_suffix('.png')}")


def write(args, model_name, prompt, trials, variants, lengths, depths, results, elapsed, stopped) -> None:
    settings = {k: v for k, v in vars(args).items() if k != "out_path"}
    settings["data"] = corpus_record(args.data)
    settings["out"], settings["model"] = relative(args.out), args.model and relative(args.model)
    if args.retrieval_heads is None:  # recorded where head_hybrid ran
        del settings["retrieval_heads"]
    else:
        settings["retrieval_heads"] = relative(args.retrieval_heads)
    text = table(results, variants, lengths, depths, args.cache_size)
    payload = {
        "description": __doc__.split("\n\n")[0],
        "settings": {
            **settings,
            "lengths": lengths,
            "depths": depths,
            "variants": variants,
            "needle": NEEDLE,
            "question": QUESTION,
            "primer": PRIMER,
            "prompt_tokens": {"prefix": len(prompt.prefix), "suffix": len(prompt.suffix)},
            "chat_template": prompt.chat,
            "scoring": "first number in the answer == passkey",
            "chunking": "chunk_size tokens (None: each policy's default_chunk_size, fair chunks) at "
            "multiples of chunk_size of the tokens a cache has read, cut short at shared branch "
            "points (needle positions, document ends), in scanned forwards of up to 256 tokens",
        },
        "command": command_line(),
        "data": describe_source(args.data),
        "versions": versions(model_name),
        "trials_completed": len(trials),
        "stopped": stopped,
        "trials": [{k: v for k, v in trial.items() if k not in ("filler", "boundaries")} for trial in trials],
        "seconds": round(elapsed, 1),
        "accuracy": {
            v: {f"{n}/{d}": acc for (n, d), acc in accuracy_grid(results, v, lengths, depths).items()} for v in variants
        },
        "table": text,
        "results": results,
    }
    args.out_path.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out_path.with_suffix(".json"), payload)
    heatmap(
        results,
        variants,
        lengths,
        depths,
        args.cache_size,
        args.out_path.with_suffix(".png"),
        f"{model_name}: passkey retrieval, cache {args.cache_size} per layer & KV head, "
        f"{len(trials)} trial(s) per cell",
    )
