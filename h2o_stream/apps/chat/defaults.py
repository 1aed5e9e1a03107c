"""The chat's defaults: cache, chunk and sampling (read by the command line's options, without torch)."""

DEFAULT_CACHE_SIZE = 512
DEFAULT_CHUNK_SIZE = 64
#: The chat's sampling: nucleus sampling with transformers' repetition penalty on the reply's own tokens. Tried on
#: eight chat prompts (one-off questions, a story, a poem, a list, a three-turn conversation) with the default model,
#: SmolLM2-135M-Instruct: without the penalty a reply can loop (a poem repeating one line to the token limit; greedy
#: decoding looped in 4 of 8); with 1.1 none of 24 replies over three seeds did (nor greedy decoding with 1.1), and
#: replies still end on their own (1.2 cut answers short). No n-gram ban: it changed nothing there and would forbid
#: naming a long name twice.
CHAT_SAMPLING = {
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 0,
    "repetition_penalty": 1.1,
    "no_repeat_ngram_size": 0,
    "max_new_tokens": 256,
}
