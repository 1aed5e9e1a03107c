"""Accelerator check in one go (under 10 minutes): correctness of every policy on the device, then timings.

The device machine reaches no network, so the default model cannot be fetched there; this script needs no files:
1. correctness: a tiny random llama (MHA and GQA) streams 96 tokens through every registered policy on the device,
   exact and fair chunked, in float32, bfloat16 and float16; float32 logits must match the same run on the CPU
   (1e-3) with the same kept entries in every layer and head; in every dtype the scores stay float64 (float32 on MPS)
   and no logit is NaN;
2. timings: a random model of SmolLM2-135M's exact shape (speed does not depend on the weights' values) on the
   device: tokens/s of fair chunked streaming (h2o, sink; cache 256, each policy's default chunk) against the model's
   raw chunked forward doing the same work, and of exact mode against the raw decode step, per dtype;
3. rows (`ppl --rows`): h2o, sink, tova and a2sf as the rows of one batched forward on the device, float32 logits
   against each cache alone (1e-3), then the SmolLM2-shaped model's sweep tokens/s as 4 rows against the 4 runs one
   after another (scanned forwards of 256, each policy's default chunk), per dtype.

    python eval/device_check.py --device cuda --out $OUT/device_check.json     # on the device machine
    python -m eval device --device cpu --timed-tokens 256 --out device_check.json   # a dry run on a CPU

It imports nothing from the other suites, so that it runs as a script as well as `python -m eval device`.
"""

from __future__ import annotations

import os
import platform
import sys
import time

import click
import torch
import transformers
from transformers import DynamicCache

from h2o_stream import StreamingCache, make_policy
from h2o_stream.engine import POLICIES, RowsCache, default_chunk_size
from h2o_stream.files import write_json

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: SmolLM2-135M-Instruct's shape (its config.json)
SMOLLM2 = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=101,
    max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def random_llama(shape: dict, device, dtype, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**shape, **overrides}, initializer_range=0.2)
    return transformers.LlamaForCausalLM(config).eval().to(device=device, dtype=dtype)


class TinyTokenizer:
    """What sepllm asks of a tokenizer: its size, special ids and the text of each id (every third is a comma)."""

    all_special_ids = [0, 1]

    def __len__(self):
        return TINY["vocab_size"]

    def batch_decode(self, sequences, **kwargs):
        return ["," if ids[0] % 3 == 0 else f"w{ids[0]}" for ids in sequences]


@torch.no_grad()
def stream(model, policy, ids: torch.Tensor, chunk: int):
    cache = StreamingCache(model, policy)
    logits = torch.cat(
        [model(ids[:, s : s + chunk], cache=cache).logits[0].float().cpu() for s in range(0, ids.shape[1], chunk)]
    )
    return logits, cache


def correctness(device) -> list[dict]:
    rows = []
    ids = torch.randint(2, TINY["vocab_size"], (1, 96), generator=torch.Generator().manual_seed(1))
    for kv_heads in (4, 2):
        reference = random_llama(TINY, "cpu", torch.float32, num_key_value_heads=kv_heads)
        for dtype_name, dtype in DTYPES.items():
            model = random_llama(TINY, device, dtype, num_key_value_heads=kv_heads)
            for name in POLICIES:
                for chunk in (1, 4):
                    policy = _policy(name)
                    row = {"kv_heads": kv_heads, "dtype": dtype_name, "policy": name, "chunk": chunk}
                    try:
                        logits, cache = stream(model, policy, ids.to(device), chunk)
                        scores = {str(layer.scores.dtype) for layer in cache.layers if layer.scores is not None}
                        row.update(nan=bool(torch.isnan(logits).any()), score_dtypes=sorted(scores))
                        if dtype is torch.float32:
                            expected, cpu_cache = stream(reference, _policy(name), ids, chunk)
                            row["max_logit_difference_vs_cpu"] = (logits - expected).abs().max().item()
                            row["same_kept_entries_as_cpu"] = all(
                                torch.equal(a.positions.cpu(), b.positions)
                                for a, b in zip(cache.layers, cpu_cache.layers, strict=True)
                                if a.positions is not None
                            )
                        row["ok"] = (
                            not row["nan"]
                            and row.get("max_logit_difference_vs_cpu", 0) < 1e-3
                            and row.get("same_kept_entries_as_cpu", True)
                            and all(d in ("torch.float64", "torch.float32") for d in scores)
                        )
                    except Exception as error:  # noqa: BLE001 - a check reports every failure and goes on
                        row.update(ok=False, error=f"{type(error).__name__}: {error}")
                    rows.append(row)
                    print(row, flush=True)
    return rows


def _policy(name: str):
    return make_policy(name, None if not POLICIES[name].parts else 16, tokenizer=TinyTokenizer())


@torch.no_grad()
def _tokens_per_second(step, tokens: int, per_call: int, sync) -> float:
    step()  # warm up (kernels, allocator)
    sync()
    started = time.perf_counter()
    for _ in range(max(1, tokens // per_call)):
        step()
    sync()
    return max(1, tokens // per_call) * per_call / (time.perf_counter() - started)


def timings(device, dtype, tokens: int, cache_size: int = 256) -> dict:
    model = random_llama(SMOLLM2, device, dtype)
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    ids = torch.randint(0, SMOLLM2["vocab_size"], (1, cache_size + 4 * tokens), device=device)
    position = {"at": cache_size}

    def next_ids(count):
        start = position["at"]
        position["at"] = cache_size + (start - cache_size + count) % (3 * tokens)
        return ids[:, start : start + count]

    out = {}
    for name in ("h2o", "sink"):
        policy = make_policy(name, cache_size)
        chunk = default_chunk_size(policy)
        for mode, step_size in (("chunked", chunk), ("exact", 1)):
            count = tokens if mode == "chunked" else tokens // 8  # decode is slow: fewer tokens
            cache = StreamingCache(model, policy)
            for s in range(0, cache_size, chunk):
                model(ids[:, s : s + chunk], cache=cache)

            def policy_step(step_size=step_size, cache=cache):
                model(next_ids(step_size), cache=cache)

            out[f"{name} {mode}"] = _tokens_per_second(policy_step, count, step_size, sync)
            held = cache_size if policy.band() is not None or mode == "exact" else cache_size + 1 - chunk
            raw_name = f"raw {held}+{step_size}"
            if raw_name in out:  # h2o and sink share the raw decode step
                continue
            raw = DynamicCache(config=model.config)
            model(ids[:, :held], cache=raw)

            def raw_step(raw=raw, step_size=step_size):
                model(next_ids(step_size), cache=raw)
                raw.crop(-step_size)

            out[raw_name] = _tokens_per_second(raw_step, count, step_size, sync)
    return out


ROW_POLICIES = ("h2o", "sink", "tova", "a2sf")


def _row_caches(model, cache_size: int) -> list[StreamingCache]:
    caches = []
    for name in ROW_POLICIES:
        policy = make_policy(name, cache_size)
        caches.append(StreamingCache(model, policy, decide_every=default_chunk_size(policy)))
    return caches


@torch.no_grad()
def rows_check(device) -> dict:
    """Each row of a RowsCache on the device against its cache alone (float32 logits, 1e-3; the same kept entries)."""
    model = random_llama(TINY, device, torch.float32, num_key_value_heads=2)
    ids = torch.randint(2, TINY["vocab_size"], (1, 96), generator=torch.Generator().manual_seed(2)).to(device)
    rows, alone = _row_caches(model, 16), _row_caches(model, 16)
    batch, worst = RowsCache(model, rows), 0.0
    for start in range(0, 96, 32):
        piece = ids[:, start : start + 32]
        logits = model(piece.expand(len(rows), -1), cache=batch).logits
        for i, cache in enumerate(alone):
            worst = max(worst, (logits[i] - model(piece, cache=cache).logits[0]).abs().max().item())
    same = all(
        torch.equal(a.positions, b.positions)
        for r, c in zip(rows, alone, strict=True)
        for a, b in zip(r.layers, c.layers, strict=True)
    )
    return {"max_logit_difference": worst, "same_kept_entries": same, "ok": worst < 1e-3 and same}


@torch.no_grad()
def rows_timings(device, dtype, tokens: int, cache_size: int = 256, span: int = 256) -> dict:
    """The SmolLM2-shaped model's sweep tokens/s: 4 runs as rows of one forward, and one after another."""
    model = random_llama(SMOLLM2, device, dtype)
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    ids = torch.randint(0, SMOLLM2["vocab_size"], (1, tokens), device=device)
    warm = _row_caches(model, cache_size)  # kernels and allocator, for both shapes of forward
    model(ids[:, :span].expand(len(warm), -1), cache=RowsCache(model, warm))
    model(ids[:, :span], cache=_row_caches(model, cache_size)[0])
    out = {}
    for way in ("rows", "one after another"):
        caches = _row_caches(model, cache_size)
        sync()
        started = time.perf_counter()
        if way == "rows":
            batch = RowsCache(model, caches)
            for s in range(0, tokens, span):
                model(ids[:, s : s + span].expand(len(caches), -1), cache=batch)
        else:
            for cache in caches:
                for s in range(0, tokens, span):
                    model(ids[:, s : s + span], cache=cache)
        sync()
        out[way] = len(caches) * tokens / (time.perf_counter() - started)
    return out


def environment() -> dict:
    """Versions, threads, machine and the command line (absolute paths made relative to the current directory)."""
    words = [os.path.relpath(w) if os.path.isabs(w) else w for w in sys.argv[1:]]
    script = "python -m eval" if sys.argv[0].endswith("__main__.py") else f"python {os.path.relpath(sys.argv[0])}"
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "command": " ".join([script, *words]),
    }


@click.command()
@click.option("--device", default="cuda", show_default=True)
@click.option("--timed-tokens", default=8192, show_default=True, help="Tokens per timed chunked measurement.")
@click.option("--out", default="eval/results/device_check.json", show_default=True)
def main(device, timed_tokens, out):
    """Correctness of every policy on the device, then timings (under 10 minutes on a GPU)."""
    started = time.perf_counter()
    report = {
        "benchmark": "device check",
        "device": device,
        "environment": environment(),
        "device_name": torch.cuda.get_device_name(0) if device.startswith("cuda") else device,
    }
    report["correctness"] = checks = correctness(device)
    report["correctness_ok"] = all(row["ok"] for row in checks)
    report["timings_tokens_per_second"] = {
        name: timings(device, dtype, timed_tokens)
        for name, dtype in DTYPES.items()
        if device != "cpu" or dtype is torch.float32
    }
    report["rows_check"] = rows_check(device)
    report["rows_sweep_tokens_per_second"] = {
        name: rows_timings(device, dtype, timed_tokens)
        for name, dtype in DTYPES.items()
        if device != "cpu" or dtype is torch.float32
    }
    report["seconds"] = time.perf_counter() - started
    write_json(out, report)
    print(
        f"correctness: {sum(r['ok'] for r in checks)}/{len(checks)} ok; timings: "
        f"{report['timings_tokens_per_second']}; rows {report['rows_check']}, "
        f"{report['rows_sweep_tokens_per_second']}; {report['seconds']:.0f} s"
    )


if __name__ == "__main__":
    main()
