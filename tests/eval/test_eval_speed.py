"""`python -m eval speed` and `python -m eval profile`: each speed part, run for a tiny config on a tiny random model,
writes the same JSON schema as its committed result; the profile splits what fair chunks add by operator; the raw
twin of a sliding-window model keeps its window."""

from __future__ import annotations

import pytest
import torch

from eval.common import alternate
from support.eval_results import committed, shape, suite, written_json


def test_alternate_rotates_the_order_and_sums_each_round():
    calls = []
    steps = {name: (lambda r, i, name=name: calls.append((r, i, name)) or 1.0) for name in "abc"}
    seconds = alternate(steps, rounds=2, per_round=2)
    assert seconds == {name: [2.0, 2.0] for name in "abc"}
    firsts = [calls[k][2] for k in range(0, len(calls), 3)]
    assert firsts == ["a", "b", "c", "a"]  # who goes first rotates at every step


def test_speed_decode_writes_the_committed_schema(tiny, tmp_path):
    suite(
        "speed",
        "decode",
        "--model",
        tiny,
        "--cache-size",
        "64",
        "--rounds",
        "2",
        "--block",
        "2",
        "--threads",
        "1,2",
        "--out-dir",
        str(tmp_path),
    )
    for name in ("decode_1thread.json", "decode_2threads.json"):
        assert shape(written_json(tmp_path / name)) == shape(committed(f"speed/{name}"))
        assert (tmp_path / name).with_suffix(".png").is_file()


def test_speed_scan_writes_the_committed_schema(tiny, tmp_path):
    suite(
        "speed",
        "scan",
        "--model",
        tiny,
        "--cache-size",
        "64",
        "--span",
        "32",
        "--rounds",
        "1",
        "--tokens",
        "16",
        "--step-tokens",
        "2",
        "--out-dir",
        str(tmp_path),
    )
    # its contenders follow each policy's default chunk (roco's was 8 when the committed file was measured)
    free = frozenset(
        {
            "threads",
            "tokens_per_second",
            "seconds_per_token_per_round",
            "vs_raw_forward",
            "vs_raw_decode_step",
            "vs_raw_decode_step_in_inference_mode",
        }
    )
    written = written_json(tmp_path / "exact_scan.json")
    assert shape(written, free) == shape(committed("speed/exact_scan.json"), free)
    assert written["threads"].keys() == {"1", "2"}


def test_speed_fair_writes_the_committed_schemas(tiny, tmp_path):
    suite(
        "speed",
        "fair",
        "--model",
        tiny,
        "--cache-size",
        "64",
        "--rounds",
        "1",
        "--round-tokens",
        "32",
        "--exact-round-tokens",
        "2",
        "--out-dir",
        str(tmp_path),
    )
    for name in ("fair_chunks_chunked.json", "fair_chunks_exact.json"):
        written, kept = written_json(tmp_path / name), committed(f"speed/{name}")
        # keyed by policy: the committed table also has those run only when named (head_hybrid)
        assert shape(written, FAIR_FREE) == shape(kept, FAIR_FREE)
        assert set(written["throughput"]) <= set(kept["throughput"])  # every default policy is in the committed table
        assert written["data"]["name"] == "sample" and len(written["data"]["sha256"]) == 64


FAIR_FREE = frozenset({"throughput"})


def test_speed_rows_writes_the_committed_schema(tiny, tmp_path):
    suite("speed", "rows", "--model", tiny, "--rounds", "1", "--tokens", "64", "--out-dir", str(tmp_path))
    written = written_json(tmp_path / "rows.json")
    assert shape(written) == shape(committed("speed/rows.json"))
    assert all(gap == 0 for gap in written["mean_abs_token_nll_difference"].values())  # rows equal runs alone


def test_speed_startup_times_the_three_commands(tmp_path):
    suite("speed", "startup", "--rounds", "1", "--out-dir", str(tmp_path))
    written = written_json(tmp_path / "startup.json")
    statuses = {command: row["exit_status"] for command, row in written["commands"].items()}
    assert statuses == {"h2o-stream --help": 0, "h2o-stream ppl --help": 0, "h2o-stream ppl --nope": 2}
    assert all(row["max_seconds"] >= row["median_seconds"] > 0 for row in written["commands"].values())


def test_profile_splits_what_fair_chunks_add_to_their_twin_by_operator(tiny, tmp_path):
    out = tmp_path / "profile"
    suite("profile", "--model", tiny, "--policies", "sink,snapkv", "--cache-size", "64", "--rounds", "2",
          "--round-tokens", "32", "--out", str(out))  # fmt: skip
    written = written_json(out.with_suffix(".json"))
    assert list(written["policies"]) == ["sink", "snapkv"] and out.with_suffix(".png").stat().st_size > 0
    for row in written["policies"].values():
        totals, extra = row["ms_per_1k_tokens"], row["extra_ms_per_1k_tokens"]
        assert totals["policy"] > 0 and totals["raw"] > 0 and {"other added", "the twin's own"} <= set(extra)
        assert extra["other added"] >= 0 >= extra["the twin's own"]
        # the operators shown and the two sums add up to the whole difference between the two
        assert sum(extra.values()) == pytest.approx(totals["policy"] - totals["raw"], rel=1e-6, abs=1e-6)
        shown = [op for op in extra if op not in ("other added", "the twin's own")]
        assert all(extra[op] > 0 for op in shown)
        assert all(row["policy_ms_per_1k_tokens"][op] - row["raw_ms_per_1k_tokens"][op] == pytest.approx(extra[op])
                   for op in shown)  # fmt: skip
        assert [extra[op] for op in shown] == sorted((extra[op] for op in shown), reverse=True)
    assert written["policies"]["snapkv"]["chunk_size"] == 4 and written["policies"]["sink"]["chunk_size"] == 256


def test_the_twin_of_a_sliding_window_model_keeps_its_window_and_crops(tmp_path):
    # Gemma 3's sliding layers trim themselves in transformers' cache unless told to keep what `crop` takes back
    from eval.speed.fair import twin_caches, twin_prefix
    from h2o_stream import make_policy
    from support.tiny_models import WINDOW, tiny_model

    model = tiny_model("gemma3_text")
    policy = make_policy("sink", WINDOW // 2)
    prefix = twin_prefix(model, policy)
    assert prefix == WINDOW  # the window is longer than the budget: both caches are fed the window first
    stream = torch.randint(0, model.config.vocab_size, (prefix + 3 * 4,))
    caches, chunk, held = twin_caches(model, policy, stream)
    raw, kinds = caches["raw"], model.config.layer_types
    # between timed forwards: the global layers what the policy's hold, the sliding ones their window less the
    # newest token (as transformers keeps them, and as the policy's sliding layers do)
    steady = [held if kind == "full_attention" else WINDOW - 1 for kind in kinds]
    for start in range(prefix, stream.numel(), 4):
        with torch.no_grad():
            model(stream[start : start + 4].unsqueeze(0), cache=raw)
        raw.crop(-4)
        assert [layer.keys.shape[-2] for layer in raw.layers] == steady
