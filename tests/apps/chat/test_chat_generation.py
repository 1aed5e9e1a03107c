"""The generation layer (h2o_stream.generation): settings, transformers' processors, the streamer, stop ids, and the
decode loop through a StreamingCache checked against transformers' own `model.generate`."""

from __future__ import annotations

import pytest
import torch
from transformers import TopPLogitsWarper

from h2o_stream import H2OStreamError, StreamingCache, make_policy
from h2o_stream.engine.feed import feed
from h2o_stream.generation import (
    Decoder,
    Sampling,
    TextStream,
    end_of_turn_id,
    generate,
    logits_processors,
    pick_token,
    stop_token_ids,
)
from h2o_stream.generation.sampling import SortFreeTopPLogitsWarper
from support.chat_helpers import TRAINING_TEXTS, tiny_tokenizer  # noqa: F401  (TRAINING_TEXTS: for conftest's tokenizer)
from support.tiny_models import tiny_llama


def sample_token(logits, sampling, generator):
    return pick_token(logits, [], sampling, logits_processors(sampling), generator)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-1), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(seed=-3), "seed"),
        (dict(top_k=-1), "top_k"),
        (dict(repetition_penalty=0.5), "repetition_penalty"),
        (dict(no_repeat_ngram_size=1.5), "no_repeat_ngram_size"),
    ],
)
def test_bad_sampling_settings(kwargs, message):
    with pytest.raises(H2OStreamError, match=message):
        Sampling(**kwargs)


# --- choosing a token ---------------------------------------------------------------------------------------------


def test_greedy_top_p_and_seeded_sampling():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    generator = torch.Generator().manual_seed(0)
    assert sample_token(logits, Sampling(temperature=0), generator) == 1
    assert {sample_token(logits, Sampling(temperature=1, top_p=0.01), generator) for _ in range(20)} == {1}
    assert {sample_token(logits, Sampling(temperature=5, top_p=1), generator) for _ in range(200)} == {0, 1, 2, 3}
    draws = [
        [sample_token(logits, Sampling(temperature=1), torch.Generator().manual_seed(s)) for s in range(30)]
        for _ in range(2)
    ]
    assert draws[0] == draws[1]


def test_the_sort_free_top_p_gives_exactly_what_transformers_top_p_gives():
    generator = torch.Generator().manual_seed(0)
    cases = []
    for top_p in (0.05, 0.5, 0.9, 0.95, 0.999):
        for scale in (0.5, 3.0, 12.0):  # flat to peaked distributions over a 49k vocabulary, as the default model's
            cases += [(top_p, torch.randn(1, 49152, generator=generator) * scale) for _ in range(4)]
    with_inf = torch.randn(1, 5000, generator=generator)
    with_inf[0, ::7] = float("-inf")  # banned tokens (no-repeat n-grams)
    cases.append((0.9, with_inf))
    ties = torch.tensor([[5.0, 1.0, 1.0, 1.0, 1.0, 0.0]])  # the cut falls inside the run of 1.0s: the parent decides
    cases += [(0.97, ties), (0.95, ties), (0.5, ties), (0.999, ties)]
    cases += [
        (0.9, torch.randn(2, 300, generator=generator)),  # a batch, float64 and NaN: the parent's own path
        (0.9, torch.randn(1, 300, generator=generator, dtype=torch.float64)),
        (0.9, torch.tensor([[1.0, float("nan"), 2.0]])),
        (0.9, torch.tensor([[float("-inf")] * 3])),
    ]
    cuts = set()
    for top_p, scores in cases:
        expected = TopPLogitsWarper(top_p)(None, scores.clone())
        got = SortFreeTopPLogitsWarper(top_p)(None, scores.clone())
        assert torch.equal(got.isnan(), expected.isnan())
        assert torch.equal(got.nan_to_num(), expected.nan_to_num()), (top_p, scores.shape)
        cuts.add(int(torch.isinf(got).sum()))
    assert len(cuts) > 10  # the cases cut in many places, not all nowhere or everywhere


def test_the_processors_change_the_distribution_as_the_settings_say():
    logits = torch.tensor([2.0, -1.0, 1.0, 0.5, 3.0])
    seen = [0, 1, 4, 0]  # tokens 0, 1, 4 already in the reply; the 2-gram (4, 0) ends it: (0, 1) came before
    scores = logits_processors(Sampling(temperature=0.5, top_p=1, repetition_penalty=2.0, no_repeat_ngram_size=2))(
        torch.tensor([seen]), logits.reshape(1, -1).clone()
    )[0]
    # penalty: positive logits divided by 2, negative multiplied; token 1 follows 0 once already: banned; then /0.5
    assert scores.tolist() == [2.0, float("-inf"), 2.0, 1.0, 3.0]
    probs = torch.softmax(
        logits_processors(Sampling(temperature=1, top_p=1, top_k=2))(
            torch.tensor([[]], dtype=torch.long), logits.reshape(1, -1).clone()
        ),
        -1,
    )[0]
    assert (probs > 0).tolist() == [True, False, False, False, True]
    greedy = Sampling(temperature=0, repetition_penalty=4.0)
    assert pick_token(logits, [], greedy, logits_processors(greedy), None) == 4
    assert pick_token(logits, [4], greedy, logits_processors(greedy), None) == 0  # 3.0 / 4 < 2.0


# --- stop ids -----------------------------------------------------------------------------------------------------


def test_stop_ids_come_from_the_tokenizer_the_generation_config_and_the_templates_end_token(tokenizer, model):
    im_end, endoftext = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert end_of_turn_id(tokenizer) == im_end and stop_token_ids(tokenizer) == {im_end}
    other = tiny_tokenizer(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert end_of_turn_id(other) == endoftext and stop_token_ids(other) == {im_end, endoftext}
    assert stop_token_ids(other, chat_template=False) == {im_end}
    assert end_of_turn_id(tiny_tokenizer(None)) is None
    plain_text_closing = tiny_tokenizer("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    assert end_of_turn_id(plain_text_closing) is None  # "\n" is no special token
    saved = model.generation_config.eos_token_id
    try:
        model.generation_config.eos_token_id = [endoftext, 7]
        assert stop_token_ids(tokenizer, model) == {im_end, endoftext, 7}
    finally:
        model.generation_config.eos_token_id = saved


# --- text ---------------------------------------------------------------------------------------------------------


def test_text_streams_whole_characters_only(tokenizer):
    text = "système ✓ 日本語 😀 €!"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tokenizer.decode([token]) for token in ids)  # some characters span several tokens
    stream = TextStream(tokenizer)
    deltas = [stream.push(token) for token in ids] + [stream.finish()]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    assert sum(bool(d) for d in deltas) > 2  # it streams, not all at the end


def test_text_stream_holds_back_and_cuts_at_a_stop_string(tokenizer):
    stream = TextStream(tokenizer, ("\nUser:",))
    out, stopped = [], False
    for token in tokenizer("four.\nUsers\nUser: more", add_special_tokens=False)["input_ids"]:
        out.append(stream.push(token))
        stopped = stream.stopped is not None
        if stopped:
            break
    assert stopped and "".join(out) == "four.\nUsers" and stream.stopped == "\nUser:"
    assert stream.finish() == ""


# --- the decode loop ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompted(tokenizer):
    """A model, a prompt and a function giving a fresh cache holding the prompt with the logits after it."""
    model = tiny_llama(len(tokenizer), seed=3)
    prompt = torch.tensor(
        [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": "hello world"}], add_generation_prompt=True, return_dict=False
            )
        ]
    )

    def start(policy="full", size=None):
        cache = StreamingCache(model, make_policy(policy, size))
        return cache, feed(model, cache, prompt, 4)

    return model, prompt, start


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0, repetition_penalty=1.3, no_repeat_ngram_size=2),
        dict(temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.2, seed=5),
        dict(temperature=1.5, top_p=0.95, no_repeat_ngram_size=3, seed=11),
    ],
    ids=["greedy", "sampled", "hot"],
)
def test_decoding_through_the_cache_gives_what_model_generate_gives(tokenizer, prompted, settings):
    """Same settings, same tokens: the processors are transformers' own, and a seeded torch.Generator draws as
    model.generate draws from torch's global generator seeded alike."""
    model, prompt, start = prompted
    sampling = Sampling(max_new_tokens=24, **settings)
    cache, logits = start()
    result = generate(model, tokenizer, cache, logits, sampling, stop_ids=[], context_ids=prompt[0].tolist())
    sampled = not sampling.greedy
    torch.manual_seed(sampling.seed)
    expected = model.generate(
        prompt,
        max_new_tokens=24,
        do_sample=sampled,
        temperature=sampling.temperature if sampled else None,
        top_k=sampling.top_k if sampled else None,
        top_p=sampling.top_p if sampled else None,
        repetition_penalty=sampling.repetition_penalty,
        no_repeat_ngram_size=sampling.no_repeat_ngram_size or None,
        eos_token_id=None,
        pad_token_id=0,
    )[0, prompt.shape[1] :].tolist()
    assert result.token_ids == expected
    assert result.stop_reason == "length" and result.fed == 23 and cache.seen == prompt.shape[1] + 23


def test_seeded_sampling_is_reproducible_and_the_seed_matters(tokenizer, prompted):
    model, _, start = prompted
    runs = {}
    for seed in (1, 1, 2):
        cache, logits = start("h2o", 16)
        runs.setdefault(seed, []).append(
            generate(
                model, tokenizer, cache, logits, Sampling(temperature=1.0, max_new_tokens=20, seed=seed), stop_ids=[]
            ).token_ids
        )
    assert runs[1][0] == runs[1][1] and runs[1][0] != runs[2][0]
    # a generator passed in continues its stream; restoring its state replays it
    generator = torch.Generator().manual_seed(3)
    state = generator.get_state()
    cache, logits = start()
    first = generate(
        model, tokenizer, cache, logits, Sampling(temperature=1.0, max_new_tokens=8), stop_ids=[], generator=generator
    ).token_ids
    generator.set_state(state)
    cache, logits = start()
    assert (
        generate(
            model,
            tokenizer,
            cache,
            logits,
            Sampling(temperature=1.0, max_new_tokens=8),
            stop_ids=[],
            generator=generator,
        ).token_ids
        == first
    )


def test_streamed_pieces_are_the_full_decode(tokenizer, prompted):
    model, _, start = prompted
    cache, logits = start()
    pieces = []
    result = generate(
        model,
        tokenizer,
        cache,
        logits,
        Sampling(temperature=1.0, max_new_tokens=40, seed=4),
        stop_ids=[],
        on_text=pieces.append,
    )
    assert len(pieces) > 1 and "".join(pieces) == result.text
    assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True).lstrip()


def test_a_stop_token_ends_the_reply_and_is_not_kept(tokenizer, prompted):
    model, prompt, start = prompted
    cache, logits = start()
    greedy = generate(model, tokenizer, cache, logits, Sampling(temperature=0, max_new_tokens=10), stop_ids=[])
    ids = greedy.token_ids
    at = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # a token that first comes there
    cache, logits = start()
    stopped = generate(model, tokenizer, cache, logits, Sampling(temperature=0, max_new_tokens=10), stop_ids=[ids[at]])
    assert stopped.stop_reason == "eos" and stopped.stop_string is None
    assert stopped.token_ids == ids[:at] and stopped.fed == at and cache.seen == prompt.shape[1] + at


def test_a_stop_string_ends_the_reply_before_it(tokenizer, prompted):
    model, _, start = prompted
    cache, logits = start()
    sampling = Sampling(temperature=1.0, max_new_tokens=40, seed=4)
    full = generate(model, tokenizer, cache, logits, sampling, stop_ids=[])
    stop = full.text[len(full.text) // 2 :][:3]
    cache, logits = start()
    cut = generate(model, tokenizer, cache, logits, sampling, stop_ids=[], stop_strings=(stop,))
    assert cut.stop_reason == "eos" and cut.stop_string == stop
    assert cut.text == full.text[: full.text.index(stop)] and len(cut.token_ids) < len(full.token_ids)
    assert cut.fed == len(cut.token_ids) - 1  # the token that completed the stop string is not fed


def test_should_stop_cancels_and_the_result_stays_readable_after_closing(tokenizer, prompted):
    model, prompt, start = prompted
    cache, logits = start()
    polls = iter(range(1000))
    result = generate(
        model,
        tokenizer,
        cache,
        logits,
        Sampling(temperature=1.0, max_new_tokens=50),
        stop_ids=[],
        should_stop=lambda: next(polls) >= 6,
    )
    assert result.stop_reason == "cancelled" and len(result.token_ids) == 6 == result.fed
    assert cache.seen == prompt.shape[1] + 6
    cache, logits = start()
    # seeded: the stream yields text only once it decodes, and random byte tokens can withhold it for long
    decoder = Decoder(model, tokenizer, Sampling(temperature=1.0, max_new_tokens=50, seed=0), stop_ids=[])
    stream = decoder.stream(cache, logits)
    next(stream), next(stream)
    generated = list(decoder.result.token_ids)
    stream.close()
    assert decoder.result.token_ids == generated and 0 < len(generated) < 50 and decoder.result.text
