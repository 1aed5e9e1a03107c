"""Model files for the loader tests: a tiny llama written as a GGUF file, and the logits to compare loads by."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

#: token ids every loaded model is run on (all below the tiny models' vocabulary sizes)
TOKENS = torch.tensor([[1, 5, 9, 30, 31, 33, 7, 2, 12, 40]])


def logits(model, tokens=TOKENS) -> torch.Tensor:
    """`model`'s logits for `tokens`, without gradients."""
    with torch.no_grad():
        return model(tokens).logits


def write_tiny_gguf(model, path: Path) -> Path:
    """Write a llama `model` as a float32 llama GGUF, laid out the way llama.cpp's converter does it."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    # A byte-level BPE vocabulary: three control tokens, the letters, and a few merges.
    tokens = ["<unk>", "<s>", "</s>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "th", "he", "the", "in"]
    tokens += [f"<extra_{i}>" for i in range(len(tokens), config.vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["t h", "h e", "th e", "i n"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)

    def permute(weight, heads):  # llama.cpp reorders q/k rows for its rotary layout; transformers undoes it
        halves = weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        return halves.swapaxes(1, 2).reshape(weight.shape)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not config.tie_word_embeddings:  # llama.cpp writes the output head only when it is not the embedding
        names["lm_head.weight"] = "output.weight"
    for i in range(config.num_hidden_layers):
        hf, gg = f"model.layers.{i}.", f"blk.{i}."
        names |= {
            hf + "input_layernorm.weight": gg + "attn_norm.weight",
            hf + "self_attn.q_proj.weight": gg + "attn_q.weight",
            hf + "self_attn.k_proj.weight": gg + "attn_k.weight",
            hf + "self_attn.v_proj.weight": gg + "attn_v.weight",
            hf + "self_attn.o_proj.weight": gg + "attn_output.weight",
            hf + "post_attention_layernorm.weight": gg + "ffn_norm.weight",
            hf + "mlp.gate_proj.weight": gg + "ffn_gate.weight",
            hf + "mlp.up_proj.weight": gg + "ffn_up.weight",
            hf + "mlp.down_proj.weight": gg + "ffn_down.weight",
        }
    state = model.state_dict()
    for hf_name, gguf_name in names.items():
        weight = state[hf_name].detach().numpy().astype(np.float32)
        if hf_name.endswith("q_proj.weight"):
            weight = permute(weight, config.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            weight = permute(weight, config.num_key_value_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(weight))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
