"""Tiny random-weight models and a tiny byte-level BPE tokenizer, built on the fly (no downloads).
Shared by the test fixtures, the GPU tests and the benchmarks' smoke tests."""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Paged attention keeps the KV cache in fixed-size blocks; a radix tree shares prefixes.",
    "你好，世界！今天天气很好。我们一起去公园散步吧。",
    "Emoji time: 🌍🚀🎉 and 👩‍💻 work fine, héllo wörld, naïve café.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Once upon a time there was a small model that answered every question with care.",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer(path: Path, vocab_size: int = 384) -> int:
    """Train a byte-level BPE, save it as a Hugging Face tokenizer into ``path``; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(str(path))
    return len(fast)


def build_model(path: Path, arch: str, vocab_size: int, seed: int = 0, **overrides) -> Path:
    import torch
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=0, pad_token_id=0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                                        "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 128})
        cls = transformers.LlamaForCausalLM
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**common, tie_word_embeddings=True, head_dim=32, sliding_window=None)
        cls = transformers.MistralForCausalLM
    elif arch == "mistral-window":  # every layer a sliding window of 8 tokens
        cfg = transformers.MistralConfig(**common, tie_word_embeddings=False, head_dim=32, sliding_window=8)
        cls = transformers.MistralForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":  # layer 0 full attention, layer 1 a sliding window of 8 tokens
        cfg = transformers.Qwen3Config(**common, tie_word_embeddings=False, head_dim=32, use_sliding_window=True,
                                       sliding_window=8, max_window_layers=1)
        cls = transformers.Qwen3ForCausalLM
    elif arch in ("phi3", "phi3-longrope"):  # fused qkv/gate_up in the checkpoint; half of each head turns
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        if arch == "phi3-longrope":  # Phi-4-mini's kind: LongRoPE, its short factors below 256 tokens
            rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                    "short_factor": [1.0 + 0.1 * i for i in range(4)], "long_factor": [2.0 + i for i in range(4)],
                    "original_max_position_embeddings": 256}
        cfg = transformers.Phi3Config(**common, tie_word_embeddings=False, rope_parameters=rope,
                                      original_max_position_embeddings=256 if arch == "phi3-longrope" else 4096)
        cls = transformers.Phi3ForCausalLM
    elif arch == "mixtral":  # 16 experts, top 2 (always renormalised)
        cfg = transformers.MixtralConfig(**dict(common, intermediate_size=48), num_local_experts=16,
                                         num_experts_per_tok=2, tie_word_embeddings=False, sliding_window=None)
        cls = transformers.MixtralForCausalLM
    elif arch == "qwen3-moe":  # 32 experts, top 4, renormalised; layer 1 a dense MLP
        cfg = transformers.Qwen3MoeConfig(**common, head_dim=32, moe_intermediate_size=24, num_experts=32,
                                          num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[1],
                                          tie_word_embeddings=False)
        cls = transformers.Qwen3MoeForCausalLM
    elif arch in ("gemma2", "gemma3"):  # layers 0 and 2 a sliding window of 4 tokens, layer 1 full attention
        # query_pre_attn_scalar 24, not head_dim: a scale read from the wrong field shows
        gemma = dict(common, head_dim=32, sliding_window=4, query_pre_attn_scalar=24, tie_word_embeddings=True)
        gemma["num_hidden_layers"] = 3
        if arch == "gemma2":  # soft caps small enough to bind (the real ones: 50 and 30)
            cfg = transformers.Gemma2Config(**gemma, attn_logit_softcapping=3.0, final_logit_softcapping=5.0)
            cls = transformers.Gemma2ForCausalLM
        else:
            # RoPE per layer type, as Gemma 3 ships: local base 1e4, global base 1e6 scaled linearly by 8
            cfg = transformers.Gemma3TextConfig(**gemma, sliding_window_pattern=2, rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})
            cls = transformers.Gemma3ForCausalLM
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():  # larger weights than the 0.02 init: peaked, diverse next-token choices
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.25)
            elif arch.startswith("gemma") and name.endswith("norm.weight"):  # (1 + w): zeros would hide w
                p.normal_(0.0, 0.3)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def write_gguf(hf_dir: Path, out: Path, arch: str) -> Path:
    """A GGUF file of a tiny HF model (float32 tensors under llama.cpp's names, the config as GGUF
    keys, the embedded SmolLM2's tokenizer, so the model's vocabulary must be its 49152), written
    with the gguf package: what llama.cpp's converter would write for these architectures."""
    import json

    import gguf
    from safetensors.torch import load_file

    from prefixkv.model.loader import embedded_gguf_path

    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg["num_hidden_layers"])
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_vocab_size(cfg["vocab_size"])
    fields = gguf.GGUFReader(str(embedded_gguf_path())).fields
    w.add_tokenizer_model(fields["tokenizer.ggml.model"].contents())
    w.add_tokenizer_pre(fields["tokenizer.ggml.pre"].contents())
    w.add_token_list(fields["tokenizer.ggml.tokens"].contents())
    w.add_token_types(fields["tokenizer.ggml.token_type"].contents())
    w.add_token_merges(fields["tokenizer.ggml.merges"].contents())
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(fields["tokenizer.chat_template"].contents())
    for name, t in tensors.items():
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
