"""Tiny random-weight models of several RoPE families, built from configs (no downloads)."""

from __future__ import annotations

import torch
import transformers

VOCAB = 101
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    max_position_embeddings=1024,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=1,
)

FAMILIES = {
    # family: (config class, model class, extra config)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2)),  # qkv bias
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_attention_heads=4, num_key_value_heads=1)),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.5),
    ),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(num_attention_heads=4, rotary_pct=0.25)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=24)),
    "llama_yarn": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 256,
            },
        ),
    ),
    "llama3_scaling": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "rope_theta": 500000.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        ),
    ),
}

WINDOW = 8  # the sliding window of the tiny hybrid families: short streams slide many times
_SW = ["sliding_attention", "full_attention", "sliding_attention"]  # three layers: two sliding around a global one

# Families whose layers attend differently (sliding windows beside global layers); each tiny model has 3 layers.
HYBRID_FAMILIES = {
    # Gemma 2: logit soft-capping (attention and final), query_pre_attn_scalar, alternating layers
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=3,
            sliding_window=WINDOW,
            layer_types=_SW,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=8.0,
        ),
    ),
    # Gemma 3 (text): QK-norm, local and global rope bases, linear rope scaling on the global layers
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            num_hidden_layers=3,
            sliding_window=WINDOW,
            layer_types=_SW,
            query_pre_attn_scalar=24,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        ),
    ),
    # Mistral with a sliding window: every layer slides
    "mistral_sliding": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=3, sliding_window=WINDOW),
    ),
    # Qwen2 with use_sliding_window: layers from max_window_layers on slide
    "qwen2_sliding": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=3,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
        ),
    ),
    # Cohere2: interleaved rotary on the sliding layers, no positions at all on the global ones
    "cohere2": (
        "Cohere2Config",
        "Cohere2ForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3, sliding_window=WINDOW, layer_types=_SW),
    ),
    # GPT-OSS: learned attention sinks, YaRN, mixture of experts
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=3,
            sliding_window=WINDOW,
            layer_types=_SW,
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 150_000.0,
                "original_max_position_embeddings": 256,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        ),
    ),
}
FAMILIES.update(HYBRID_FAMILIES)


def tiny_model(family: str = "llama", *, seed: int = 0, init_std: float | None = None, **overrides):
    """A random-weight causal LM; a larger `init_std` gives peakier attention (fewer near-ties in H2O scores)."""
    config_name, model_name, extra = FAMILIES[family]
    kwargs = {**COMMON, **extra, **overrides}
    if init_std is not None:
        kwargs["initializer_range"] = init_std
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).eval()


def random_ids(length: int, *, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (1, length), generator=generator)


def char_tokenizer():
    """A character-level tokenizer over printable ASCII with a BOS it adds itself (ids fit VOCAB)."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{ch: i + 3 for i, ch in enumerate(chars[: VOCAB - 3])}}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def save_tiny_model_dir(path, family: str = "llama", **overrides):
    """A tiny model + char tokenizer saved as a local model directory, loadable with --model PATH."""
    model = tiny_model(family, **overrides)
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


# --- chat-style tokenizer and model (chat and summarize tests) ------------------------------------------------------

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def bpe_tokenizer(training_texts: list[str], template: str | None = SMOLLM2_TEMPLATE):
    """A byte-level BPE tokenizer (400 tokens) trained on `training_texts`, with SmolLM2's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    )
    backend.train_from_iterator(training_texts * 10, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    tokenizer.chat_template = template
    return tokenizer


def tiny_llama(vocab: int, *, seed: int = 0, layers: int = 2, context: int = 1024, dtype=torch.float32):
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval().to(dtype)
