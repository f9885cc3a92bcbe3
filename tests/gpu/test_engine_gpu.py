"""The GPU engine end to end: greedy outputs equal transformers' on tiny random models (float32,
TF32 off), CUDA-graph replay equals eager, and a replay after the inputs changed gives the new
answer (the kernels run inside the graph)."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("cupy")

from prefixkv import LLM, SamplingParams  # noqa: E402

from tiny_models import build_model, build_tokenizer  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old[:2]
    torch.set_float32_matmul_precision(old[2])


@pytest.fixture(scope="module", params=[("llama", 64), ("mistral", 128)])
def gpu_model(request, tmp_path_factory):
    arch, head_dim = request.param
    path = tmp_path_factory.mktemp(f"gpu-{arch}")
    vocab = build_tokenizer(path)
    build_model(path, arch, vocab, head_dim=head_dim)
    return path


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 384) for _ in range(40)]
    return [(shared if i % 2 else []) + [rng.randrange(3, 384) for _ in range(rng.randrange(1, 70))] for i in range(n)]


def _hf_greedy(path, prompts, max_tokens):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda()
    refs = []
    for p in prompts:
        out = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=max_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    assert all(len(r) == max_tokens for r in refs), "transformers stopped early (eos_token_id=None ignored?)"
    return refs


@pytest.mark.parametrize("block_size,chunk", [(16, 512), (32, 24)])
def test_gpu_engine_greedy_equals_transformers(gpu_model, block_size, chunk):
    prompts = _prompts(9)
    refs = _hf_greedy(gpu_model, prompts, 16)
    llm = LLM(model=str(gpu_model), device="cuda", dtype="float32", block_size=block_size,
              max_num_batched_tokens=chunk, num_kv_blocks=256, max_num_seqs=16)
    llm.engine.check_integrity_each_step = True
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    assert llm.engine.scheduler.kv.num_used_blocks == 0


def test_graphs_equal_eager_and_are_replayed(gpu_model):
    prompts = _prompts(5, seed=3)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=1)
    eager = LLM(model=str(gpu_model), device="cuda", dtype="float32", enforce_eager=True, max_num_seqs=8,
                num_kv_blocks=512)
    graphs = LLM(model=str(gpu_model), device="cuda", dtype="float32", max_num_seqs=8, num_kv_blocks=512)
    assert graphs.engine.runner.graphs is not None and eager.engine.runner.graphs is None
    assert [o.token_ids for o in graphs.generate(prompts, sp)] == [o.token_ids for o in eager.generate(prompts, sp)]
    # n=2 forks, copy-on-write and padded buckets under graphs too
    sp2 = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=2)
    g2 = graphs.generate(prompts[:3], sp2)
    e2 = eager.generate(prompts[:3], sp2)
    assert [[c.token_ids for c in o.outputs] for o in g2] == [[c.token_ids for c in o.outputs] for o in e2]


def test_replay_reads_new_inputs(gpu_model):
    llm = LLM(model=str(gpu_model), device="cuda", dtype="float32", max_num_seqs=4, num_kv_blocks=64)
    runner = llm.engine.runner
    g = runner.graphs
    from prefixkv.attention import AttentionMetadata

    block = 1  # a real block (no request holds one): the dummy block is the padding rows' to write

    def step(tokens):
        # sequence i writes its K/V into slot i of `block` and attends to slots 0..i; 3 sequences
        # replay the 4-bucket graph, whose padding row writes into the dummy block
        n = len(tokens)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device="cuda") + block * g.block_size,
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device="cuda"),
            seq_lens=torch.arange(1, n + 1, dtype=torch.int32, device="cuda"),
            block_tables=torch.full((n, 2), block, dtype=torch.int32, device="cuda"),
            num_decode_seqs=n, max_seq_len=g.max_model_len, max_query_len=1)
        ids = torch.tensor(tokens, device="cuda")
        pos = torch.arange(n, dtype=torch.int64, device="cuda")
        replayed = g.replay(ids, pos, meta).clone()
        eager = runner.model(ids, pos, runner.kv_cache, [meta] * len(runner.kv_cache), runner.backend,
                             torch.arange(n, device="cuda"))
        return replayed, eager

    assert g.bucket_for(3) == 4
    r1, e1 = step([5, 6, 7])
    r2, e2 = step([9, 10, 11])
    torch.testing.assert_close(r1, e1, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(r2, e2, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(r1, r2)


def test_bf16_engine_runs(gpu_model):
    llm = LLM(model=str(gpu_model), device="cuda", dtype="bfloat16", max_num_seqs=8, num_kv_blocks=512)
    outs = llm.generate(_prompts(6), SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert all(len(o.token_ids) == 10 for o in outs)
    assert llm.engine.scheduler.kv.num_used_blocks == 0


def test_dtype_auto_and_kv_cache_sized_from_free_memory(gpu_model):
    """dtype auto on CUDA: the checkpoint is float32, so bfloat16; no num_kv_blocks: the KV cache
    takes what gpu_memory_utilization leaves after the weights and the profiled activation peak."""
    import gc

    free0, total = torch.cuda.mem_get_info()
    llm = LLM(model=str(gpu_model), device="cuda", gpu_memory_utilization=0.3, max_num_seqs=8)
    assert llm.engine.runner.dtype_name == "bfloat16" and llm.engine.runner.kv_cache.dtype == torch.bfloat16
    kv_bytes = llm.engine.runner.kv_cache.numel() * 2
    used_before = total - free0
    assert 0 < kv_bytes <= 0.3 * total - used_before
    assert kv_bytes > 0.8 * (0.3 * total - used_before) - (1 << 30)  # most of the budget, less weights/peak
    outs = llm.generate(_prompts(4), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert all(len(o.token_ids) == 6 for o in outs)
    del llm, outs
    gc.collect()
    torch.cuda.empty_cache()


def test_torch_attention_backend_on_cuda_equals_transformers(gpu_model):
    """The fallback where the CuPy kernels cannot run: --attention-backend torch on the GPU."""
    prompts = _prompts(5, seed=3)
    refs = _hf_greedy(gpu_model, prompts, 12)
    llm = LLM(model=str(gpu_model), device="cuda", dtype="float32", attention_backend="torch", num_kv_blocks=256,
              max_num_seqs=8)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs


@pytest.mark.parametrize("arch,head_dim", [("gemma2", 256), ("mistral-window", 64), ("gemma3", 128), ("mixtral", 64)])
def test_gpu_windowed_and_capped_models_equal_transformers(tmp_path, arch, head_dim):
    """Issue 15: sliding-window layers (windows of 4 and 8) and Gemma 2's soft-capped scores and
    logits through the CUDA kernels (head_dim 256: the SIMT prefill tiles), and sparse MoE (eager:
    no CUDA graphs for it), greedy against transformers on the GPU, chunked and not. The windowed
    models run with KV cache groups (their blocks before the window freed; Gemma's several groups
    decode eagerly, Mistral's one windowed group through the CUDA graphs)."""
    vocab = build_tokenizer(tmp_path)
    build_model(tmp_path, arch, vocab, head_dim=head_dim)
    prompts = _prompts(7, seed=5)
    refs = _hf_greedy(tmp_path, prompts, 12)
    for chunk in (512, 24):
        llm = LLM(model=str(tmp_path), device="cuda", dtype="float32", block_size=16, max_num_batched_tokens=chunk,
                  num_kv_blocks=256, max_num_seqs=16)
        assert llm.engine.runner.kv_plan.hybrid == (arch != "mixtral")
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        assert [o.token_ids for o in outs] == refs, chunk
