"""The CUDA kernels under the emulator's race modes (tests/kernel_emu): every instantiation the CUDA
backend launches for each dtype and head_dim it takes, run in index order, in reverse and in a
seeded random order (CTAs and threads, every barrier and shuffle a switch point) with outputs
bitwise equal, and with the shared-memory race check on throughout (a word written by one thread
and accessed by another with no barrier between fails the launch). Then the check's teeth: each
kernel with one of its __syncwarp / __syncthreads removed is caught, and copy_blocks given pairs
that race (the host check bypassed) gives different blocks in reverse CTA order."""

from __future__ import annotations

import functools
import math
import re

import pytest
import torch

from kernel_emu import EmulatorError, KernelEmulator, _sources, build_from_sources, emulated, find_compiler, \
    same_under_schedules
from kernel_reference import make_batch, reference_attention

pytestmark = pytest.mark.skipif(find_compiler() is None, reason="no C++ compiler for the kernel emulator")

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
HEAD_DIMS = (32, 64, 80, 96, 128, 256)
TOL = {F16: 5e-3, BF16: 3e-2, F32: 1e-4}

# (dtype, head_dim): GQA groups 1-8 spread over them; decode contexts long enough for several
# 32-token chunks per warp (the p_s reuse) and, split, two 512-token partitions
_GROUPS = {32: 3, 64: 8, 80: 4, 96: 2, 128: 5, 256: 1}
DECODE_CASES = [(dt, d, _GROUPS[d]) for dt in (F16, BF16, F32) for d in HEAD_DIMS]
# prefill: two 64-key tiles for the last rows (the K/V buffers reused), a prefix-hit chunk
PREFILL_CASES = [(dt, d, impl) for dt in (F16, BF16, F32) for d in HEAD_DIMS for impl in ("simt", "mma")
                 if (impl == "simt" and not (dt == F32 and d == 256)) or (impl == "mma" and dt != F32 and d <= 128)]


def _decode(dtype, head_dim, qpk, seed=0):
    from prefixkv.attention import cuda as kernels

    outs = []
    for split, lens in ((False, [300, 7]), (True, [600, 40])):
        b = make_batch(dtype, head_dim, 16, 1, qpk, [(L, 1) for L in lens], seed)
        outs.append(kernels.paged_decode_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"],
                                                   1 / math.sqrt(head_dim), b["max_seq_len"], split_k=split))
        outs.append(reference_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], b["query_start_loc"],
                                        1 / math.sqrt(head_dim)))
    return outs


def _prefill(dtype, head_dim, impl, seed=0):
    from prefixkv.attention import cuda as kernels

    specs = [(70, 70)] if impl == "mma" else [(50, 40), (9, 9)]
    b = make_batch(dtype, head_dim, 16, 1, 1 if impl == "mma" else 2, specs, seed)
    scale = 1 / math.sqrt(head_dim)
    out = kernels.paged_prefill_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"],
                                          b["query_start_loc"], scale, b["max_query_len"], impl=impl)
    return [out, reference_attention(b["q"], b["cache"], b["block_tables"], b["seq_lens"], b["query_start_loc"], scale)]


def _cache_ops(dtype, seed=0):
    from prefixkv.attention import cuda as kernels

    g = torch.Generator().manual_seed(seed)
    cache = torch.randn((2, 7, 2, 16, 64), generator=g).to(dtype)
    k, v = torch.randn((2, 5, 2, 64), generator=g).to(dtype)
    kernels.write_kv(k, v, cache, torch.tensor([3, 17, 40, 41, 95]))
    kv_cache = torch.randn((2, 2, 7, 2, 16, 64), generator=g).to(dtype)
    kernels.copy_blocks(kv_cache, torch.tensor([[1, 4], [2, 5], [1, 6]]))
    return [cache, kv_cache]


def _all_cases():
    for dt, d, qpk in DECODE_CASES:
        yield f"decode-{str(dt)[6:]}-d{d}-g{qpk}", lambda dt=dt, d=d, qpk=qpk: _decode(dt, d, qpk)
    for dt, d, impl in PREFILL_CASES:
        yield f"prefill-{impl}-{str(dt)[6:]}-d{d}", lambda dt=dt, d=d, impl=impl: _prefill(dt, d, impl)
    for dt in (F16, BF16, F32):
        yield f"cache-ops-{str(dt)[6:]}", lambda dt=dt: _cache_ops(dt)


CASES = dict(_all_cases())


@pytest.fixture(scope="module")
def race_emulator() -> KernelEmulator:
    """One race-check build of every instantiation the cases launch: for each dtype and head_dim the
    backend takes, everything ``name_expressions`` lists (decode plain and split-K, reduce, SIMT and
    tensor-core prefill where it applies, KV write, block copy)."""
    from prefixkv.attention import cuda as kernels

    names: set[str] = set()
    with emulated(None, record=names):
        for run in CASES.values():
            run()
    for dt, d, qpk in DECODE_CASES:
        if kernels.unsupported_reason(dt, d, qpk, 1) is None:
            want = {n for ns in kernels.name_expressions(dt, d, 16, qpk).values() for n in ns}
            assert want <= names, want - names
    return KernelEmulator.for_names(names, race_check=True)


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_are_race_free_and_schedule_independent(race_emulator, name):
    """Index order, reverse and a seeded random order, every collective interleaved: bitwise the
    same outputs, no race flagged, and the index-order outputs right."""
    run = CASES[name]
    with emulated(race_emulator, num_sms=132):
        results = same_under_schedules(race_emulator, run, seeds=(1,))
    outs = results["index"]
    if name.startswith(("decode", "prefill")):
        dtype = outs[0].dtype
        for got, want in zip(outs[::2], outs[1::2]):
            assert not got.isnan().any()
            torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


# ---- the race check catches a missing barrier in every kernel ------------------------------------

# name: (file, the barrier's line with enough context to be unique, which occurrence, the kernel run,
#        the shared arrays the race may be reported on)
MUTANTS = {
    "decode-q_s-filled": ("paged_decode.cu", "    q_s[g][i % HEAD_DIM] = x;\n  }\n  __syncthreads();", 1, "decode",
                          "q_s"),
    "decode-p_s-written": ("paged_decode.cu", "      p_s[warp][lane][g] = p;\n    }\n    __syncwarp();", 1, "decode",
                           "p_s"),
    "decode-p_s-read": ("paged_decode.cu",
                        "acc[g][j] = fmaf(p, vf[j], acc[g][j]);\n      }\n    }\n    __syncwarp();", 1, "decode", "p_s"),
    "decode-merge": ("paged_decode.cu", "  __syncthreads();\n\n  for (int i = tid; i < num_active * HEAD_DIM", 1,
                     "decode", "red_m|red_l|red_acc"),
    "simt-q-k-landed": ("paged_prefill.cu", "cp_async_wait<1>();  // Q and K(it) have landed (V(it) may still be in "
                        "flight)\n    __syncthreads();", 1, "simt", "q_s|k_s"),
    "simt-k_s-free": ("paged_prefill.cu", "__syncthreads();  // p_s complete; k_s free", 1, "simt", "k_s"),
    "simt-v-landed": ("paged_prefill.cu", "cp_async_wait<1>();  // V(it) has landed\n    __syncthreads();", 1, "simt",
                      "v_s|p_s"),
    "simt-v_s-free": ("paged_prefill.cu", "__syncthreads();  // v_s and p_s free", 1, "simt", "v_s|p_s"),
    "mma-q-landed": ("paged_prefill.cu", "cp_async_wait<0>();\n  __syncthreads();\n  unsigned int qf", 1, "mma", "k_s"),
    "mma-q-in-registers": ("paged_prefill.cu", "__syncthreads();  // Q fragments are in registers; k_s is free for K",
                           1, "mma", "k_s"),
    "mma-k-landed": ("paged_prefill.cu", "cp_async_wait<1>();  // K(it) has landed\n    __syncthreads();", 1, "mma",
                     "k_s"),
    "mma-k_s-free": ("paged_prefill.cu", "__syncthreads();  // every warp is done with k_s", 1, "mma", "k_s"),
    "mma-v-landed": ("paged_prefill.cu", "cp_async_wait<1>();  // V(it) has landed\n    __syncthreads();", 2, "mma",
                     "v_s"),
    "mma-v_s-free": ("paged_prefill.cu", "__syncthreads();  // every warp is done with v_s", 1, "mma", "v_s"),
}


def _round(mutant: str) -> int:
    """Mutants of different kernels share a build: round r removes the r-th barrier of each kernel."""
    kind = MUTANTS[mutant][3]
    return [m for m in MUTANTS if MUTANTS[m][3] == kind].index(mutant)


@functools.cache
def _mutant_build(round_: int) -> KernelEmulator:
    """A race-check build with the barriers of this round's mutants removed (each replaced by a
    comment; positions found in the unmodified sources)."""
    sources = _sources()
    cuts: dict[str, list[tuple[int, int]]] = {}
    for mutant, (file_name, context, occurrence, _, _) in MUTANTS.items():
        if _round(mutant) != round_:
            continue
        text = sources[file_name]
        starts = [m.start() for m in re.finditer(re.escape(context), text)]
        assert len(starts) >= occurrence, f"{context!r} found {len(starts)} times in {file_name}"
        at = starts[occurrence - 1] + max(context.rfind("__syncthreads();"), context.rfind("__syncwarp();"))
        cuts.setdefault(file_name, []).append((at, text.index(";", at) + 1))
    for file_name, spans in cuts.items():
        for at, end in sorted(spans, reverse=True):
            sources[file_name] = sources[file_name][:at] + "/* removed */" + sources[file_name][end:]
    names: set[str] = set()
    with emulated(None, record=names):
        for kind in ("decode", "simt", "mma"):
            _mutant_run(kind)()
    return KernelEmulator(build_from_sources(sources, names, race_check=True), race_check=True)


def _mutant_run(kind):
    if kind == "decode":  # plain and split-K, 300 / 512 tokens: several 32-token chunks per warp
        return lambda: _decode(F16, 64, 2)
    return lambda: _prefill(F16, 64, kind)


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_race_check_catches_each_removed_barrier(mutant):
    """Every __syncthreads / __syncwarp of the decode, SIMT prefill and tensor-core prefill kernels,
    removed one at a time: the launch fails with a shared-memory race on the arrays that barrier
    guards (a read before the write, a write over data another thread has yet to read, or an access
    to a cp.async destination before its wait and barrier)."""
    _, _, _, kind, arrays = MUTANTS[mutant]
    emu = _mutant_build(_round(mutant))
    race = rf"shared-memory race: thread \d+ \(warp \d\) (reads|writes) ({arrays})\[byte \d+\]"
    with emulated(emu), pytest.raises(EmulatorError, match=race):
        _mutant_run(kind)()


def test_schedules_show_copy_pairs_that_race():
    """Two pairs with one destination, launched past the host check: the CTAs' order decides the
    block's content, so reverse order gives other bits than index order."""
    from prefixkv.attention import cuda as kernels

    def run():
        kv_cache = torch.arange(2 * 2 * 5 * 2 * 16 * 8, dtype=torch.float32).view(2, 2, 5, 2, 16, 8)
        pairs = torch.tensor([[1, 3], [2, 3]])
        args = (kv_cache.data_ptr(), pairs.data_ptr(), kernels._i64(5), kernels._i64(2 * 16 * 8))
        emu.launch(kernels._cache_op_name("copy_blocks_kernel", torch.float32), (2, 4, 1), 128, args)
        return kv_cache

    names = {kernels._cache_op_name("copy_blocks_kernel", torch.float32)}
    emu = KernelEmulator.for_names(names)
    with pytest.raises(AssertionError, match="under the reverse schedule differs bitwise"):
        same_under_schedules(emu, run, orders=("reverse",))
