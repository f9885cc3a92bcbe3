"""Per-family pieces against transformers' own modules (the end-to-end greedy identity of every
family is in tests/test_lossless.py): the sparse MoE block bit for bit, with many experts and tied
router scores, renormalised or not; checkpoints whose experts are fused tensors; Phi-3's LongRoPE
limits; the refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from prefixkv import LLM, SamplingParams
from prefixkv.model.loader import load_model


def _hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64, experts_implementation="eager")


@pytest.mark.parametrize("arch,renormalize,dtype", [("tiny_mixtral", True, "float64"), ("tiny_qwen3_moe", True, "float64"),
                                                    ("tiny_qwen3_moe", False, "float64"),
                                                    # bfloat16: where Mixtral's float32 weights and
                                                    # Qwen3-MoE's cast-first differ in the bits
                                                    ("tiny_mixtral", True, "bfloat16"),
                                                    ("tiny_qwen3_moe", True, "bfloat16")])
def test_moe_block_is_bitwise_transformers_with_tied_router_scores(request, arch, renormalize, dtype):
    model_dir = request.getfixturevalue(arch)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype), experts_implementation="eager")
    ours, _ = load_model(model_dir, dtype, "cpu")
    hf_block, our_block = hf.model.layers[0].mlp, ours.model.layers[0].mlp
    n = our_block.num_experts
    assert n >= 16 and len(our_block.experts) == n
    # experts 3 and 11 get the same router row: every token scores them equally (a tie in top-k)
    w = hf_block.gate.weight.detach().clone()
    w[11] = w[3]
    hf_block.gate.weight.data.copy_(w)
    our_block.gate.weight.data.copy_(w)
    if arch == "tiny_qwen3_moe":
        hf_block.gate.norm_topk_prob = renormalize
        our_block.renormalize = renormalize
    x = torch.randn(53, w.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(0)).to(w.dtype)
    _, hf_weights, hf_ids = hf_block.gate(x)
    weights, ids = our_block.route(x)
    assert torch.equal(ids, hf_ids)
    assert torch.equal(weights.to(torch.float64), hf_weights.to(torch.float64))
    tied = ((ids == 3) | (ids == 11)).sum(dim=-1) == 2
    assert tied.any()  # some tokens picked both tied experts
    want = hf_block(x[None])[0]  # [53, hidden]
    assert torch.equal(our_block(x), want)
    if renormalize:
        torch.testing.assert_close(weights.double().sum(-1), torch.ones(53, dtype=torch.float64),
                                   atol=1e-2 if dtype == "bfloat16" else 1e-6, rtol=0)  # renormalised in float32


def test_fused_expert_tensors_load_the_same(tiny_qwen3_moe, tmp_path):
    """transformers 5 holds a layer's experts as [E, 2I, H] gate_up and [E, H, I] down tensors; a
    checkpoint saved that way loads into the same model."""
    fused = tmp_path / "fused"
    shutil.copytree(tiny_qwen3_moe, fused)
    (st,) = fused.glob("*.safetensors")
    tensors = load_file(str(st))
    cfg = json.loads((fused / "config.json").read_text())
    out = {}
    for name, t in tensors.items():
        if ".mlp.experts." not in name:
            out[name] = t
    layers = {name.split(".mlp.experts.")[0] for name in tensors if ".mlp.experts." in name}
    for layer in layers:
        e = range(cfg.get("num_experts") or cfg["num_local_experts"])  # (saved as num_local_experts)
        gate = [tensors[f"{layer}.mlp.experts.{i}.gate_proj.weight"] for i in e]
        up = [tensors[f"{layer}.mlp.experts.{i}.up_proj.weight"] for i in e]
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([tensors[f"{layer}.mlp.experts.{i}.down_proj.weight"]
                                                            for i in e])
    st.unlink()
    save_file(out, str(st), metadata={"format": "pt"})
    a, _ = load_model(tiny_qwen3_moe, "float64", "cpu")
    b, _ = load_model(fused, "float64", "cpu")
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    prompt = [[5, 17, 99, 3, 250, 7, 11]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert (LLM(model=str(fused), dtype="float64").generate(prompt, params)[0].token_ids
            == LLM(model=str(tiny_qwen3_moe), dtype="float64").generate(prompt, params)[0].token_ids)


def test_phi3_longrope_is_served_in_its_short_regime(tiny_phi3_longrope, caplog):
    with caplog.at_level("WARNING"):
        llm = LLM(model=str(tiny_phi3_longrope), dtype="float64")
    assert llm.engine.info.max_model_len == 256  # its original length, not max_position_embeddings (1024)
    assert "served up to its original 256 tokens" in caplog.text
    assert LLM(model=str(tiny_phi3_longrope), dtype="float64", max_model_len=200).engine.info.max_model_len == 200
    with pytest.raises(ValueError, match=r"^max_model_len: phi3's LongRoPE is served up to its original 256 tokens"):
        LLM(model=str(tiny_phi3_longrope), dtype="float64", max_model_len=512)
    shape = llm.engine.runner.model.shape
    assert shape.rotary_dim == 8 and shape.head_dim == 16  # partial rotary: half of each head turns


def test_unsupported_variants_are_refused(tiny_gemma2, tmp_path):
    bidi = tmp_path / "bidi"
    shutil.copytree(tiny_gemma2, bidi)
    cfg = json.loads((bidi / "config.json").read_text())
    cfg["use_bidirectional_attention"] = True
    (bidi / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"^model: use_bidirectional_attention"):
        LLM(model=str(bidi), dtype="float64")
    act = tmp_path / "act"
    shutil.copytree(tiny_gemma2, act)
    cfg["use_bidirectional_attention"] = None
    cfg["hidden_activation"] = "relu"
    (act / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"^model: hidden_act 'relu' is not supported"):
        LLM(model=str(act), dtype="float64")


def test_batch_invariance_is_on_by_default_for_the_new_families(tiny_gemma2, tiny_mistral_window, tiny_mixtral):
    """Windows and caps in the C kernels, Gemma's norms and GeGLU in C: nothing row-dependent is
    left (tests/test_batch_invariance.py checks bitwise that it holds for every family)."""
    for model_dir in (tiny_gemma2, tiny_mistral_window, tiny_mixtral):
        assert LLM(model=str(model_dir), dtype="float32").engine.runner.batch_invariant is True, model_dir



@pytest.mark.slow
def test_qwen3_gguf_loads_through_the_one_loader_and_equals_transformers(tmp_path, monkeypatch, caplog):
    """A Qwen3 GGUF (written by the gguf package as llama.cpp lays it out, head_dim 32 where the
    config class's default is 128) converts through transformers' GGUF mapping (saying so while it
    does) and generates what transformers generates from the HF original."""
    import logging

    from tiny_models import build_model, write_gguf

    monkeypatch.setenv("PREFIXKV_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    # as Qwen3 ships (no windowed layers: llama.cpp's GGUF keys have none for qwen3)
    build_model(src, "qwen3", 49152, use_sliding_window=False, sliding_window=None,
                layer_types=["full_attention", "full_attention"])
    (tmp_path / "gguf").mkdir()
    gguf_file = write_gguf(src, tmp_path / "gguf" / "tiny-qwen3.gguf", "qwen3")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float64)
    prompt = [5, 17, 99, 3, 250, 7, 11, 4000, 31000, 12]
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(prompt):].tolist()
    monkeypatch.setenv("PREFIXKV_QUIET", "0")
    with caplog.at_level(logging.INFO, logger="prefixkv"):
        llm = LLM(model=str(gguf_file), dtype="float64")
    said = [r.getMessage() for r in caplog.records if r.name == "prefixkv"]
    assert said[0] == "converting tiny-qwen3.gguf (once) ..."
    assert any(m.startswith("converting tiny-qwen3.gguf (once): done in ") for m in said)
    assert llm.engine.runner.model.shape.model_type == "qwen3" and llm.engine.runner.model.shape.head_dim == 32
    out = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == want
    # the GGUF's own tokenizer came with it (SmolLM2's, here)
    from transformers import AutoTokenizer

    smol = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    assert llm.tokenizer.encode("Hello world, héllo") == smol.encode("Hello world, héllo")



def _hf_next_logprobs(model_dir, prompt, dtype):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1].double()
    return torch.log_softmax(logits, dim=-1)


def test_gemma2_soft_caps_bind_and_match_transformers(tiny_gemma2, tmp_path):
    """Gemma 2's attention and final-logit caps (3 and 5 in the tiny model) change the
    distribution, and prefixkv's next-token logprobs equal transformers' with them."""
    prompt = list(range(5, 60))
    want = _hf_next_logprobs(tiny_gemma2, prompt, torch.float64)
    out = LLM(model=str(tiny_gemma2), dtype="float64").generate(
        [prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))[0].outputs[0]
    got = out.logprobs[0]
    assert len(got) == 5
    for tok, lp in got.items():  # (transformers' eager attention takes its softmax in float32: ~1e-7 apart)
        assert abs(lp.logprob - want[tok].item()) < 1e-6, (tok, lp.logprob, want[tok].item())
    uncapped = tmp_path / "uncapped"
    shutil.copytree(tiny_gemma2, uncapped)
    cfg = json.loads((uncapped / "config.json").read_text())
    cfg["attn_logit_softcapping"] = cfg["final_logit_softcapping"] = None
    (uncapped / "config.json").write_text(json.dumps(cfg))
    plain = _hf_next_logprobs(uncapped, prompt, torch.float64)
    assert (plain - want).abs().max().item() > 1e-2  # the caps are not idle


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3", "mistral-window"])
def test_float32_head_dim_64_families_through_the_vector_kernels(arch, tmp_path):
    """float32, head_dim 64, block size 16: the C kernels' window / soft-cap paths (AVX-512 or AVX2 decode
    and prefill), the fused C norms incl. Gemma's (1 + w) and GeGLU, against transformers in
    float32: greedy ids equal and next-token logprobs within float32 rounding."""
    from tiny_models import build_model, build_tokenizer

    vocab = build_tokenizer(tmp_path)
    build_model(tmp_path, arch, vocab, head_dim=64)
    llm = LLM(model=str(tmp_path), dtype="float32", block_size=16, max_num_batched_tokens=24)
    assert llm.engine.runner.model.model.norm.fused and llm.engine.runner.batch_invariant
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    rng = __import__("random").Random(3)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (9, 40, 70)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1))
    for p, o in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == ref
        want = _hf_next_logprobs(tmp_path, p, torch.float32)
        first = o.outputs[0].logprobs[0][ref[0]].logprob
        assert abs(first - want[ref[0]].item()) < 1e-4
