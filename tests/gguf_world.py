"""A tiny trained-tokenizer Llama checkpoint and the GGUF files made from it.

``tiny_text_checkpoint`` trains a small byte-level BPE tokenizer with the
``tokenizers`` library, builds a seeded ``transformers.LlamaForCausalLM``
whose vocabulary is that tokenizer's, and saves both (with a chat template)
as a Hugging Face checkpoint. ``write_gguf`` writes that checkpoint as a GGUF
file with the ``gguf`` package's writer, the way llama.cpp's converter does:
Q and K rows permuted for its rotary kernel, each tensor quantised to the
type asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "what is the capital of france? the capital of france is paris.",
    "name a colour: blue, red, green and 42 more",
    "hello world, hello graphs, hello tokens 12345",
] * 20

#: The types of ``write_gguf``'s default mix, by GGUF tensor kind.
MIXED_TYPES = {
    "token_embd": "F16",
    "attn_norm": "F32",
    "ffn_norm": "F32",
    "output_norm": "F32",
    "attn_q": "F32",
    "attn_k": "F16",
    "attn_v": "Q8_0",
    "attn_output": "Q4_0",
    "ffn_gate": "Q4_1",
    "ffn_up": "Q8_0",
    "ffn_down": "Q4_0",
    "output": "F32",
}


def tiny_text_checkpoint(path: Path, *, seed: int = 0) -> Any:
    """Save tokenizer + 2-layer Llama (hidden 64, 4/2 heads) to ``path``;
    returns the transformers model (eval mode)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.1,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for Q/K: within a head, the two rotary halves interleave."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(
    model: Any,
    tokenizer_dir: Path,
    out: Path,
    *,
    types: dict[str, str] | None = None,
    arch: str = "llama",
) -> dict[str, tuple[str, np.ndarray]]:
    """Write ``model`` (and the tokenizer saved in ``tokenizer_dir``) as GGUF file
    ``out``. Returns, by transformers name, each tensor's GGUF type and the
    float32 original it was written from."""
    import gguf
    from transformers import AutoTokenizer

    kinds = {**MIXED_TYPES, **(types or {})}
    cfg = model.config
    w = gguf.GGUFWriter(out, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    hf_tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    state = hf_tok.backend_tokenizer.to_str()
    import json

    bpe = json.loads(state)["model"]
    vocab = sorted(bpe["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]])
    w.add_bos_token_id(hf_tok.bos_token_id)
    w.add_eos_token_id(hf_tok.eos_token_id)
    w.add_chat_template(CHAT_TEMPLATE)
    written: dict[str, tuple[str, np.ndarray]] = {}
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    names["lm_head.weight"] = "output.weight"
    layer = {
        "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    for name, tensor in model.state_dict().items():
        if name in names:
            gname = names[name]
        else:
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{i}.{layer[rest.removesuffix('.weight')]}.weight"
        kind = gname.split(".")[-2] if gname.startswith("blk.") else gname.split(".")[0]
        qtype = kinds[kind]
        data = tensor.detach().float().numpy().copy()
        written[name] = (qtype, data.copy())
        if kind == "attn_q":
            data = _permute(data, cfg.num_attention_heads)
        elif kind == "attn_k":
            data = _permute(data, cfg.num_key_value_heads)
        if qtype == "F32":
            w.add_tensor(gname, data)
        elif qtype == "F16":
            w.add_tensor(gname, data.astype(np.float16))
        elif qtype == "I8":  # a type the importer refuses
            w.add_tensor(gname, data.astype(np.int8))
        else:
            q = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(gname, gguf.quants.quantize(data, q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written
