"""The disk KV tier (issue 12, part 2): blocks the host tier lets go of go to files, and the
files survive a restart. Lossless (greedy tokens equal transformers'), detected corruption
(a flipped byte, a truncated file, a foreign fingerprint, a leftover temporary file: each discarded,
never read into attention), strict capacity."""

from __future__ import annotations

import pytest

from prefixkv import LLM, SamplingParams

from test_host_tier import _bytes_per_block, _conversations
from test_lossless import hf_reference


def _llm(model, disk_dir, host_blocks: int = 8, disk_blocks: int = 400, **kw):
    probe = kw.pop("probe")
    gb = _bytes_per_block(probe) / (1 << 30)
    return LLM(model=str(model), dtype="float64", block_size=4, num_kv_blocks=kw.pop("num_kv_blocks", 40),
               max_num_batched_tokens=256, kv_host_cache_gb=host_blocks * gb, kv_disk_cache_dir=str(disk_dir),
               kv_disk_cache_gb=disk_blocks * gb, **kw)


@pytest.fixture(scope="module")
def probe(tiny_llama):
    return LLM(model=str(tiny_llama), dtype="float64", block_size=4, num_kv_blocks=40)


SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_blocks_spill_to_disk_and_come_back(tiny_llama, tmp_path, probe):
    llm = _llm(tiny_llama, tmp_path, probe=probe)
    llm.engine.check_integrity_each_step = True
    first = _conversations(8)
    outs1 = llm.generate(first, SP)
    second = [p + o.outputs[0].token_ids + [250, 251] for p, o in zip(first, outs1)]
    outs2 = []
    for p in second:
        outs2 += llm.generate([p], SP)
    kv = llm.engine.scheduler.kv
    assert kv.disk.num_written > 0 and kv.disk.num_read >= 0
    assert llm.engine.runner.disk.num_bytes_read > 0  # some history came back from files
    assert [o.outputs[0].token_ids for o in outs1 + outs2] == hf_reference(tiny_llama, first + second, max_tokens=6)
    assert kv.disk.num_used <= 400 and len(list(llm.engine.runner.disk.dir.glob("*.kvb"))) == kv.disk.num_used
    llm.engine.check_integrity()


def test_restart_finds_the_conversation(tiny_llama, tmp_path, probe):
    convs = _conversations(3)
    a = _llm(tiny_llama, tmp_path, probe=probe)
    turn1 = a.generate(convs, SP)
    a.close()  # a clean shutdown writes every cached block to the disk tier
    del a
    b = _llm(tiny_llama, tmp_path, probe=probe)
    turn2 = [p + o.outputs[0].token_ids + [250] for p, o in zip(convs, turn1)]
    outs = b.generate(turn2, SP)
    assert all(o.num_cached_tokens >= len(p) - 8 for p, o in zip(turn2, outs)), [o.num_cached_tokens for o in outs]
    assert [o.outputs[0].token_ids for o in outs] == hf_reference(tiny_llama, turn2, max_tokens=6)


def _restart_after(tiny_llama, tmp_path, probe, damage) -> tuple[list, LLM]:
    convs = _conversations(2)
    a = _llm(tiny_llama, tmp_path, probe=probe)
    turn1 = a.generate(convs, SP)
    a.close()
    files = sorted(a.engine.runner.disk.dir.glob("*.kvb"))
    assert files
    damage(files)
    b = _llm(tiny_llama, tmp_path, probe=probe)
    turn2 = [p + o.outputs[0].token_ids + [250] for p, o in zip(convs, turn1)]
    outs = b.generate(turn2, SP)
    assert [o.outputs[0].token_ids for o in outs] == hf_reference(tiny_llama, turn2, max_tokens=6)
    return outs, b


def test_a_flipped_byte_is_detected_and_nothing_wrong_is_used(tiny_llama, tmp_path, probe):
    def flip(files):
        for f in files:
            data = bytearray(f.read_bytes())
            data[-3] ^= 0x40  # in the payload: only the checksum can tell
            f.write_bytes(bytes(data))

    outs, b = _restart_after(tiny_llama, tmp_path, probe, flip)
    d = b.engine.runner.disk
    assert d.num_discarded > 0 and d.num_bytes_read == 0  # every file was damaged: none was read
    assert b.engine.stats()["prefix_host_hit_tokens"] == 0


def test_a_truncated_file_and_a_leftover_temporary_file(tiny_llama, tmp_path, probe):
    def cut(files):
        files[0].write_bytes(files[0].read_bytes()[:100])
        (files[0].parent / "0000000000000000.tmp").write_bytes(b"half a write")  # killed mid-spill

    outs, b = _restart_after(tiny_llama, tmp_path, probe, cut)
    d = b.engine.runner.disk
    assert d.num_discarded == 1 and not list(d.dir.glob("*.tmp"))
    assert d.num_bytes_read > 0  # the intact files were used


def test_another_fingerprint_is_never_read(tiny_llama, tmp_path, probe):
    a = _llm(tiny_llama, tmp_path, probe=probe)
    a.generate(_conversations(2), SP)
    a.close()
    gb = _bytes_per_block(probe) / (1 << 30)
    other = LLM(model=str(tiny_llama), dtype="float64", block_size=8, num_kv_blocks=20, kv_host_cache_gb=8 * gb,
                kv_disk_cache_dir=str(tmp_path), kv_disk_cache_gb=400 * gb)  # another block size: another layout
    assert other.engine.runner.disk.dir != a.engine.runner.disk.dir
    assert other.engine.scheduler.kv.disk.num_used == 0
    out = other.generate(_conversations(2)[:1], SP)[0]
    assert out.num_cached_tokens == 0


def test_disk_tier_needs_the_host_tier(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="^kv_disk_cache_dir:"):
        LLM(model=str(tiny_llama), dtype="float64", num_kv_blocks=16, kv_disk_cache_dir=str(tmp_path),
            kv_disk_cache_gb=0.01)


_WRITER = r"""
import sys
sys.path.insert(0, sys.argv[3])
from prefixkv import LLM, SamplingParams
from test_disk_tier import _round
gb = float(sys.argv[2])
llm = LLM(model=sys.argv[1], dtype="float64", block_size=4, num_kv_blocks=40, max_num_batched_tokens=256,
          kv_host_cache_gb=8 * gb, kv_disk_cache_dir=sys.argv[4], kv_disk_cache_gb=400 * gb)
i = 0
while True:  # new prompts every round, so earlier rounds' blocks go device -> host -> disk; until killed
    llm.generate(_round(i), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    print("round", i, flush=True)
    i += 1
"""


def _round(i: int) -> list[list[int]]:
    return [[3 + (i * 37 + c * 11 + k * 7) % 300 for k in range(41)] for c in range(6)]


def test_kill_9_during_spills_then_restart(tiny_llama, tmp_path, probe):
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    gb = _bytes_per_block(probe) / (1 << 30)
    tests_dir = str(Path(__file__).parent)
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tiny_llama), repr(gb), tests_dir, str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 120
        rounds = 0
        while rounds < 3 and time.monotonic() < deadline:
            if proc.stdout.readline().startswith("round"):
                rounds += 1
        assert rounds == 3
        time.sleep(0.05)  # somewhere inside the next round's spills
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
    b = _llm(tiny_llama, tmp_path, probe=probe)
    d = b.engine.runner.disk
    assert b.engine.scheduler.kv.disk.num_used > 0 and not list(d.dir.glob("*.tmp"))
    convs = _round(0)  # the oldest prompts: spilled to files long before the kill
    outs = b.generate(convs, SP)
    assert [o.outputs[0].token_ids for o in outs] == hf_reference(tiny_llama, convs, max_tokens=6)
    assert d.num_bytes_read > 0 and any(o.num_cached_tokens for o in outs)  # the killed process's files were used
    b.engine.check_integrity()


def test_the_server_engines_shutdown_writes_the_cache(tiny_llama, tmp_path, probe):
    """``prefixkv serve``'s way out (AsyncEngine shutdown) leaves every cached block on disk."""
    from prefixkv.async_engine import AsyncEngine

    a = _llm(tiny_llama, tmp_path, probe=probe)
    a.generate(_conversations(1), SP)
    assert a.engine.scheduler.kv.disk.num_used == 0  # nothing reached the disk while running
    ae = AsyncEngine(a.engine)
    ae.close()
    cached = a.engine.scheduler.kv.radix.num_cached_blocks
    assert cached > 0 and a.engine.stats()["num_disk_blocks_used"] == cached
    assert a.engine.stats()["disk_bytes_written"] == cached * a.engine.runner.disk.payload_bytes


def test_a_file_damaged_while_running_fails_that_step_not_the_output(tiny_llama, tmp_path, probe):
    """A file corrupted after the start-up scan: the read's checksum catches it, the step's requests
    end with an error (never attention over wrong KV), the file is forgotten, and the same prompt
    then gives the right tokens."""
    convs = _conversations(2)
    a = _llm(tiny_llama, tmp_path, probe=probe)
    turn1 = a.generate(convs, SP)
    a.close()
    b = _llm(tiny_llama, tmp_path, probe=probe)
    for f in b.engine.runner.disk.dir.glob("*.kvb"):  # after b's scan accepted them
        data = bytearray(f.read_bytes())
        data[-1] ^= 1
        f.write_bytes(bytes(data))
    turn2 = [convs[0] + turn1[0].outputs[0].token_ids + [250]]
    failed = b.generate(turn2, SP)[0]
    assert failed.outputs[0].finish_reason == "error" and "corrupt" in failed.error
    ok = b.generate(turn2, SP)[0]
    assert ok.outputs[0].token_ids == hf_reference(tiny_llama, turn2, max_tokens=6)[0]
    b.engine.check_integrity()
