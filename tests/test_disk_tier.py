"""The disk KV tier (issue 12, part 2): blocks the host tier lets go of go to files, and the
files survive a restart. Lossless (greedy tokens equal transformers'), detected corruption
(a flipped byte, a truncated file, a foreign fingerprint, a leftover temporary file: each discarded,
never read into attention), strict capacity."""

from __future__ import annotations

import threading
import time

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
    disk, store = llm.engine.scheduler.tiers.disk, llm.engine.runner.tiers.disk
    assert disk.num_written > 0 and disk.num_read >= 0
    assert store.num_bytes_read > 0  # some history came back from files
    assert [o.outputs[0].token_ids for o in outs1 + outs2] == hf_reference(tiny_llama, first + second, max_tokens=6)
    store.flush()  # the writer thread's queue
    assert disk.num_used <= 400 and len(list(store.dir.glob("*.kvb"))) == disk.num_used
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
    files = sorted(a.engine.runner.tiers.disk.dir.glob("*.kvb"))
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
    d = b.engine.runner.tiers.disk
    assert d.num_discarded > 0 and d.num_bytes_read == 0  # every file was damaged: none was read
    assert b.engine.stats()["prefix_host_hit_tokens"] == 0


def test_a_truncated_file_and_a_leftover_temporary_file(tiny_llama, tmp_path, probe):
    def cut(files):
        files[0].write_bytes(files[0].read_bytes()[:100])
        (files[0].parent / "0000000000000000.tmp").write_bytes(b"half a write")  # killed mid-spill

    outs, b = _restart_after(tiny_llama, tmp_path, probe, cut)
    d = b.engine.runner.tiers.disk
    assert d.num_discarded == 1 and not list(d.dir.glob("*.tmp"))
    assert d.num_bytes_read > 0  # the intact files were used


def test_another_fingerprint_is_never_read(tiny_llama, tmp_path, probe):
    a = _llm(tiny_llama, tmp_path, probe=probe)
    a.generate(_conversations(2), SP)
    a.close()
    gb = _bytes_per_block(probe) / (1 << 30)
    other = LLM(model=str(tiny_llama), dtype="float64", block_size=8, num_kv_blocks=20, kv_host_cache_gb=8 * gb,
                kv_disk_cache_dir=str(tmp_path), kv_disk_cache_gb=400 * gb)  # another block size: another layout
    assert other.engine.runner.tiers.disk.dir != a.engine.runner.tiers.disk.dir
    assert other.engine.scheduler.tiers.disk.num_used == 0
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
    d = b.engine.runner.tiers.disk
    assert b.engine.scheduler.tiers.disk.num_used > 0 and not list(d.dir.glob("*.tmp"))
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
    assert a.engine.scheduler.tiers.disk.num_used == 0  # nothing reached the disk while running
    ae = AsyncEngine(a.engine)
    ae.close()
    cached = a.engine.scheduler.kv.radix.num_cached_blocks
    assert cached > 0 and a.engine.stats()["num_disk_blocks_used"] == cached
    assert a.engine.stats()["disk_bytes_written"] == cached * a.engine.runner.tiers.disk.payload_bytes


def test_a_file_damaged_while_running_is_discarded_and_recomputed(tiny_llama, tmp_path, probe):
    """A file corrupted after the start-up scan: the prefetch's checksum catches it before the
    request is admitted, the file is deleted and forgotten, and the request recomputes from there:
    the right tokens, no error, never attention over wrong KV."""
    convs = _conversations(2)
    a = _llm(tiny_llama, tmp_path, probe=probe)
    turn1 = a.generate(convs, SP)
    a.close()
    b = _llm(tiny_llama, tmp_path, probe=probe)
    d = b.engine.runner.tiers.disk
    files = sorted(d.dir.glob("*.kvb"))
    for f in files:  # after b's scan accepted them
        data = bytearray(f.read_bytes())
        data[-1] ^= 1
        f.write_bytes(bytes(data))
    turn2 = [convs[0] + turn1[0].outputs[0].token_ids + [250]]
    out = b.generate(turn2, SP)[0]
    assert out.error is None and out.outputs[0].token_ids == hf_reference(tiny_llama, turn2, max_tokens=6)[0]
    assert out.num_cached_tokens == 0  # the first block's file was bad: nothing after it is matched
    assert d.num_bytes_read == 0 and d.num_sync_reads == 0
    for _ in range(100):
        if not d.reads_in_flight:
            break
        d.wait_reads(0.1)
    b.generate([[7, 8, 9]], SP)  # a step after the reader's last failure: all of them forgotten
    left = {f.name for f in d.dir.glob("*.kvb")}
    assert d.num_discarded >= 1 and len(left) == len(files) - d.num_discarded
    assert {d._path(k).name for k in b.engine.scheduler.tiers.disk.keys()} == left  # index == files
    b.engine.check_integrity()


def test_a_damaged_file_read_without_prefetch_raises(tiny_llama, tmp_path, probe):
    """The step's own read (a block nobody prefetched) checks the file too: DiskKVError, which the
    engine turns into an error for that step's requests (``_failed_forward``)."""
    from prefixkv.runner.disk_store import DiskKVError

    a = _llm(tiny_llama, tmp_path, probe=probe)
    a.generate(_conversations(1), SP)
    a.close()
    d = a.engine.runner.tiers.disk
    f = sorted(d.dir.glob("*.kvb"))[0]
    h, group = f.stem.split("-")
    key = (int(h, 16) - (1 << 64) if int(h, 16) >= 1 << 63 else int(h, 16), int(group))
    assert d.read(key).shape == d.block_shape and d.num_sync_reads == 1
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(DiskKVError, match="corrupt"):
        d.read(key)


# ---------------------------------------------------------------- the store's threads (no model)
def _store(tmp_path, **kw):
    import torch

    from prefixkv.runner.disk_store import DiskKVStore

    return DiskKVStore(tmp_path, "fp", 4, (2, 2, 1, 4, 3), torch.float64, **kw)


def _keys(*blocks: int) -> list[tuple[int, int]]:
    """Page keys (block hash, group 0)."""
    return [(b, 0) for b in blocks]


def _block(v: float):
    import torch

    return torch.full((2, 2, 1, 4, 3), v, dtype=torch.float64)


def test_writes_are_queued_copies_read_back_before_and_after_the_file(tmp_path):
    import torch

    d = _store(tmp_path)
    src = _block(1.0)
    d.write((11, 0), (1, 2, 3, 4), src)
    src.fill_(9.0)  # the slot reused at once: the queued copy is what gets written
    assert torch.equal(d.read((11, 0)), _block(1.0))  # from the copy or the file, whichever is first
    sync_reads = d.num_sync_reads  # (1 if the writer thread was first)
    d.flush()
    assert d.num_bytes_written == d.payload_bytes and (d.dir / f"{11:016x}-0.kvb").exists()
    assert d.scan() == [((11, 0), (1, 2, 3, 4))]
    d.write((12, 0), (5, 6, 7, 8), _block(2.0))
    d.delete((12, 0))  # in order: written, then deleted
    d.write((13, 0), (5, 6, 7, 9), _block(3.0))
    d.delete((13, 0))
    d.write((13, 0), (5, 6, 7, 9), _block(3.0))  # deleted, then written again
    d.flush()
    assert sorted(p.name for p in d.dir.glob("*.kvb")) == [f"{11:016x}-0.kvb", f"{13:016x}-0.kvb"]
    assert torch.equal(d.read((13, 0)), _block(3.0)) and d.num_sync_reads == sync_reads + 1
    assert not list(d.dir.glob("*.tmp"))


def test_the_write_queue_is_bounded(tmp_path, monkeypatch):
    """With room for one queued block, the next write waits until the writer thread has written the
    first: the step never holds more than ``write_queue_bytes`` of copies."""
    d = _store(tmp_path, write_queue_bytes=1)
    gate = threading.Event()
    real = d._path

    def slow_path(key):  # the writer thread blocks on its first file until the gate opens
        if threading.current_thread().name == "prefixkv-disk-writer":
            gate.wait(10)
        return real(key)

    monkeypatch.setattr(d, "_path", slow_path)
    d.write((1, 0), (1, 2, 3, 4), _block(1.0))
    t = threading.Thread(target=d.write, args=((2, 0), (1, 2, 3, 5), _block(2.0)))
    t.start()
    t.join(0.3)
    assert t.is_alive() and d.num_write_waits >= 1  # waiting for room
    gate.set()
    t.join(10)
    d.flush()
    assert not t.is_alive() and d.num_bytes_written == 2 * d.payload_bytes


def test_prefetch_reads_in_the_background_and_keeps_what_it_reported(tmp_path):
    import torch

    d = _store(tmp_path)
    for k in range(6):
        d.write((k, 0), (k, 1, 2, 3), _block(float(k)))
    d.flush()
    bound = 3 * d.payload_bytes
    e = _store(tmp_path, prefetch_bytes=bound)  # a new process on the same files
    assert [k for (k, _), _ in e.scan()] == list(range(6))
    for _ in range(200):
        if e.prefetch(_keys(0, 1)):
            break
        e.wait_reads(0.05)
    assert e.prefetch(_keys(0, 1)) and e.num_prefetched == 2 and e.reads_in_flight == 0
    # the same pass: room for one more: [2, 3, 4] gets 2 read, 3 and 4 wait (0 and 1 were asked
    # for earlier in the pass: they stay)
    for _ in range(200):
        assert not e.prefetch(_keys(2, 3, 4))
        if not e.reads_in_flight:
            break
        e.wait_reads(0.05)
    assert e.num_prefetched == 3 and e.prefetch(_keys(0, 1))
    assert torch.equal(e.read((0, 0)), _block(0.0)) and torch.equal(e.read((1, 0)), _block(1.0))  # taken: room
    e.begin_pass()  # the next pass: 3 and 4 come in (2 is kept: wanted again)
    for _ in range(200):
        if e.prefetch(_keys(2, 3, 4)):
            break
        e.wait_reads(0.05)
    assert e.num_prefetched == 5 and e.prefetch(_keys(2, 3, 4))
    e.begin_pass()  # a pass that wants two others: 2 and 3 make room (least recently wanted first)
    for _ in range(200):
        if e.prefetch(_keys(0, 1)):
            break
        e.wait_reads(0.05)
    assert e.num_prefetched == 7 and set(e._ready) == set(_keys(4, 0, 1))
    assert e.num_sync_reads == 0 and e.num_bytes_read == 2 * e.payload_bytes
    (e.dir / f"{5:016x}-0.kvb").write_bytes(b"garbage")
    e.begin_pass()
    for _ in range(200):
        if e.prefetch(_keys(5)) or e.reads_in_flight == 0 and e.num_discarded:
            break
        e.wait_reads(0.05)
    assert e.take_failed() == _keys(5) and e.num_discarded == 1 and not (e.dir / f"{5:016x}-0.kvb").exists()
    assert e.take_failed() == []


OTHER = [5 + (i * 7) % 90 for i in range(12)]  # a prompt that shares no block with the conversation


def _a_second_turn(model, disk_dir, probe) -> list[int]:
    """A conversation's first turn served with the disk tier in ``disk_dir``, the engine closed (its
    blocks in files, as before a restart): the token ids of the conversation's second turn."""
    convs = _conversations(1)
    a = _llm(model, disk_dir, probe=probe)
    turn1 = a.generate(convs, SP)
    a.close()
    return convs[0] + turn1[0].outputs[0].token_ids + [250]


def _hold_reads(store, seconds: float = 60.0) -> threading.Event:
    """The store's reader thread holds every read until the returned event is set."""
    gate, real_read = threading.Event(), store._read_into

    def gated(path, block):
        if threading.current_thread().name == "prefixkv-disk-reader":
            assert gate.wait(seconds)
        return real_read(path, block)

    store._read_into = gated
    return gate


def _slow_first_forward(eng, seconds: float = 1.0) -> None:
    """The engine's next forward takes ``seconds`` longer (the bound of the pass after it)."""
    real_forward, slow = eng.runner._forward, [True]

    def forward(out):
        if slow[0]:
            slow[0] = False
            time.sleep(seconds)
        return real_forward(out)

    eng.runner._forward = forward


def test_a_request_waits_for_its_files_and_the_others_go_on(tiny_llama, tmp_path, probe):
    """After a restart the conversation's blocks are on disk. While their reads are held back, a
    second request is scheduled step after step and the first waits (its blocks are not read in
    the step); once they are in, it is admitted with them cached. Both outputs exact."""
    turn2 = _a_second_turn(tiny_llama, tmp_path, probe)
    b = _llm(tiny_llama, tmp_path, probe=probe)
    d, eng = b.engine.runner.tiers.disk, b.engine
    real, calls = d.prefetch, []
    hold = [True]

    def held(keys):
        calls.append(len(keys))
        return False if hold[0] else real(keys)

    d.prefetch = held
    other = OTHER
    eng.add_request("back", turn2, SP)
    eng.add_request("other", other, SP)
    done = {}
    for _ in range(4):
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert calls and {r.request_id for r in eng.scheduler.waiting} == {"back"}
    assert eng.scheduler.tiers.num_read_waits >= 4 and d.num_bytes_read == 0
    hold[0] = False
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert done["back"].num_cached_tokens >= len(turn2) - 8
    assert d.num_prefetched > 0 and d.num_sync_reads == 0 and d.num_bytes_read > 0
    ref = hf_reference(tiny_llama, [turn2, other], max_tokens=6)
    assert [done["back"].outputs[0].token_ids, done["other"].outputs[0].token_ids] == ref
    eng.check_integrity()


def test_the_reads_of_a_request_that_must_wait_for_a_seat_start_early(tiny_llama, tmp_path, probe):
    """One seat: while the first request runs, the next one (a returning conversation, its blocks
    on disk) cannot be admitted, but its files are read meanwhile; it is then admitted at once
    with them cached, no step reading a file."""
    turn2 = _a_second_turn(tiny_llama, tmp_path, probe)
    b = _llm(tiny_llama, tmp_path, probe=probe, max_num_seqs=1)
    d, eng = b.engine.runner.tiers.disk, b.engine
    other = OTHER
    eng.add_request("other", other, SP)
    eng.add_request("back", turn2, SP)
    done = {}
    for o in eng.step():  # "other" admitted; "back" has no seat, its reads start
        done[o.request_id] = o
    assert [r.request_id for r in eng.scheduler.running] == ["other"] and d.reads_in_flight + d.num_prefetched > 0
    while "other" not in done:
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    for _ in range(100):  # (a slow machine: the reads may still run)
        if not d.reads_in_flight:
            break
        d.wait_reads(0.1)
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert done["back"].num_cached_tokens >= len(turn2) - 8 and d.num_sync_reads == 0
    assert eng.scheduler.tiers.num_read_waits == 0  # its blocks were in before its turn
    ref = hf_reference(tiny_llama, [other, turn2], max_tokens=6)
    assert [done["other"].outputs[0].token_ids, done["back"].outputs[0].token_ids] == ref


def _wait_ready(store, keys):
    for _ in range(200):
        if store.prefetch(keys):
            return
        store.wait_reads(0.05)
    raise AssertionError(f"{keys} never came in")


def test_load_into_copies_slots_queued_copies_and_unread_files_into_the_cache_layout(tmp_path):
    """``load_into`` (the step's way in): prefetched blocks come out of their slots of the one
    buffer (one copy; the slots free again after), a block whose file is still queued from its
    copy, a block nobody prefetched read now; each lands at its index of a [layers, 2, blocks, ...]
    tensor, equal to what was written, nothing else touched."""
    import torch

    d = _store(tmp_path)
    for k in range(4):
        d.write((k, 0), (k, 1, 2, 3), _block(float(k) + 0.5))
    d.flush()
    e = _store(tmp_path, prefetch_bytes=3 * d.payload_bytes)  # three slots
    assert [k for (k, _), _ in e.scan()] == [0, 1, 2, 3]
    _wait_ready(e, _keys(2, 0))
    assert sorted(e._slot_of) == _keys(0, 2) and len(e._free_slots) == 1 and e._arena.shape == (3, *e.block_shape)
    gate = threading.Event()
    real = e._path

    def slow_path(key):  # the writer thread holds key 9's file back until the gate opens
        if threading.current_thread().name == "prefixkv-disk-writer":
            gate.wait(10)
        return real(key)

    e._path = slow_path
    e.write((9, 0), (9, 9, 9, 9), _block(9.5))
    dst = torch.zeros(2, 2, 6, 1, 4, 3, dtype=torch.float64)  # the layout of the KV cache
    e.load_into(dst, [((2, 0), 5), ((9, 0), 1), ((3, 0), 0), ((0, 0), 3)])
    gate.set()
    e.flush()
    for key, i in [(2, 5), (9, 1), (3, 0), (0, 3)]:
        assert torch.equal(dst[:, :, i], _block(float(key) + 0.5))
    assert dst[:, :, [2, 4]].abs().sum() == 0
    assert e.num_sync_reads == 1 and e.num_bytes_read == 4 * e.payload_bytes  # key 3 read now
    assert not e._ready and not e._slot_of and sorted(e._free_slots) == [0, 1, 2]  # every slot free again
    # a request larger than the buffer, alone: its blocks beyond the slots in buffers of their own
    e.begin_pass()
    _wait_ready(e, _keys(0, 1, 2, 3))
    assert len(e._slot_of) == 3 and set(e._ready) == set(_keys(0, 1, 2, 3)) and not e._free_slots
    dst.zero_()
    e.load_into(dst, [((k, 0), k) for k in range(4)])
    assert all(torch.equal(dst[:, :, k], _block(k + 0.5)) for k in range(4)) and sorted(e._free_slots) == [0, 1, 2]


def test_files_carry_the_crc32c_of_their_payload(tmp_path):
    """The header's checksum is CRC-32C (the crc32c package) of the payload bytes; a file whose
    payload was changed but whose checksum was rewritten to zlib's CRC-32 (the old format) is
    refused, so is one with the old magic."""
    import struct
    import zlib

    import crc32c

    from prefixkv.runner import disk_store

    d = _store(tmp_path)
    d.write((5, 0), (1, 2, 3, 4), _block(2.25))
    d.flush()
    path = d.dir / f"{5:016x}-0.kvb"
    data = path.read_bytes()
    n0 = len(disk_store.MAGIC) + disk_store._HEADER.size + 8 * 4
    payload = data[n0:]
    assert payload == _block(2.25).numpy().tobytes()
    crc = struct.unpack_from("<qiiqI", data, len(disk_store.MAGIC))[4]  # (hash, group, block size, bytes, crc)
    assert crc == crc32c.crc32c(payload) != zlib.crc32(payload)
    assert disk_store.checksum(payload) == crc
    old = bytearray(data)
    struct.pack_into("<I", old, len(disk_store.MAGIC) + 24, zlib.crc32(payload))
    path.write_bytes(bytes(old))
    assert d.scan() == [] and d.num_discarded == 1
    d.write((6, 0), (1, 2, 3, 5), _block(1.0))
    d.flush()
    path = d.dir / f"{6:016x}-0.kvb"
    path.write_bytes(b"PKVBLK2\n" + path.read_bytes()[8:])
    assert d.scan() == [] and d.num_discarded == 2


def test_wait_ready_waits_only_for_reads_that_can_end_in_time(tmp_path):
    """``wait_ready`` (the engine's bounded wait, HiCache's "timeout" policy): True once every
    block is read; False without waiting for a block nobody is reading, for no time left, or when
    the reader's pace says the reads ahead will not end in time."""
    import torch

    d = _store(tmp_path)
    for k in range(3):
        d.write((k, 0), (k, 1, 2, 3), _block(float(k)))
    d.flush()
    e = _store(tmp_path)
    assert [k for (k, _), _ in e.scan()] == [0, 1, 2]
    gate = _hold_reads(e, 30.0)
    waits, real_wait = [], e._cv.wait

    def counted(timeout=None):
        waits.append(timeout)
        return real_wait(timeout)

    e._cv.wait = counted
    assert not e.prefetch(_keys(0, 1)) and e.reads_in_flight == 2
    assert not e.wait_ready(_keys(0, 1), 0.0)
    assert not e.wait_ready(_keys(0, 7), 30.0)  # 7 is not being read: no wait
    e.read_s_per_block = 20.0  # two reads at that pace: 40 s, over the 30 left
    assert not e.wait_ready(_keys(0, 1), 30.0)
    assert not e.wait_ready(_keys(1), 30.0)  # one block, but read after 0: 40 s too
    assert waits == [] and e.reads_in_flight == 2
    e.read_s_per_block = None
    threading.Timer(0.5, gate.set).start()
    assert e.wait_ready(_keys(0, 1), 30.0)
    assert waits and e.num_prefetched == 2 and e.reads_in_flight == 0
    assert e.read_s_per_block is not None and e.read_s_per_block > 0
    out = torch.zeros(2, 2, 2, 1, 4, 3, dtype=torch.float64)
    e.load_into(out, [((0, 0), 0), ((1, 0), 1)])
    assert torch.equal(out[:, :, 1], _block(1.0)) and e.num_sync_reads == 0


def test_a_returning_request_is_admitted_in_the_pass_its_reads_end(tiny_llama, tmp_path, probe):
    """After a restart, a returning conversation arrives while another request runs: the pass
    waits (within its bound: the last forward's time) for its files and admits it in the same step,
    its history cached, instead of putting it off a step. With no bound it waits a step as before.
    Outputs exact either way."""
    other = OTHER
    ref = None
    for bound in (30.0, 0.0):
        turn2 = _a_second_turn(tiny_llama, tmp_path / str(bound), probe)  # (each its own files)
        ref = ref or hf_reference(tiny_llama, [turn2, other], max_tokens=6)
        b = _llm(tiny_llama, tmp_path / str(bound), probe=probe)
        eng = b.engine
        eng.runner.tiers.max_wait_s = bound
        _slow_first_forward(eng)  # "other"'s first forward takes a second: the bound
        eng.add_request("other", other, SP)
        done = {o.request_id: o for o in eng.step()}
        eng.add_request("back", turn2, SP)
        seen = []
        real_schedule = eng.scheduler.schedule

        def spy():
            out = real_schedule()
            seen.append([s.req.request_id for s in out.scheduled])
            return out

        eng.scheduler.schedule = spy
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
        st = eng.stats()
        if bound:
            assert "back" in seen[0] and st["disk_wait_admissions"] == 1 and st["disk_admission_waits"] == 0
        else:
            assert seen[0] == ["other"] and any("back" in ids for ids in seen[1:])  # (once its reads end)
            assert st["disk_wait_admissions"] == 0 and st["disk_admission_waits"] >= 1 and st["disk_wait_s"] == 0
        assert done["back"].num_cached_tokens >= len(turn2) - 8
        assert [done["back"].outputs[0].token_ids, done["other"].outputs[0].token_ids] == ref
        eng.check_integrity()
        b.close()


def test_the_engine_makes_the_prefetch_buffer_at_start(tiny_llama, tmp_path, probe):
    """The prefetch buffer exists (its pages touched) before the first read, with no more slots
    than the disk tier holds; a store made without the engine still makes it at its first read."""
    llm = _llm(tiny_llama, tmp_path, probe=probe, disk_blocks=40)
    d = llm.engine.runner.tiers.disk
    num_disk_blocks = llm.engine.scheduler.tiers.disk.num_blocks
    assert d._arena is not None and d.num_prefetched == 0
    assert d._num_slots == min(d.prefetch_bytes // d.payload_bytes, num_disk_blocks) == 40
    assert d._arena.shape == (40, *d.block_shape) and sorted(d._free_slots) == list(range(40))
    llm.close()
    e = _store(tmp_path / "alone", prefetch_bytes=1024)  # blocks of 384 bytes: 2 slots
    assert e._arena is None
    e.write((1, 0), (1, 2, 3, 4), _block(1.0))
    e.flush()
    f = _store(tmp_path / "alone", prefetch_bytes=1024)
    assert [k for (k, _), _ in f.scan()] == [1]
    _wait_ready(f, _keys(1))
    assert f._arena.shape == (2, *f.block_shape) and f.num_prefetched == 1


def test_a_pass_waits_no_longer_than_the_last_forward_took(tiny_llama, tmp_path, probe):
    """With requests running, a pass's wait for reads is bounded by the last forward's time (here
    a forward slowed to 1 s under a 30 s cap): reads held back, the pass gives up after ~1 s and the
    request waits; once its reads end it is admitted, outputs exact."""
    turn2, other = _a_second_turn(tiny_llama, tmp_path, probe), OTHER
    b = _llm(tiny_llama, tmp_path, probe=probe)
    eng = b.engine
    eng.runner.tiers.max_wait_s = 30.0
    gate = _hold_reads(eng.runner.tiers.disk)
    _slow_first_forward(eng)
    eng.add_request("other", other, SP)
    done = {o.request_id: o for o in eng.step()}
    assert eng.runner.tiers.last_forward_s >= 1.0
    eng.add_request("back", turn2, SP)
    for o in eng.step():  # waits ~1 s (the last forward), not 30, then goes on without "back"
        done[o.request_id] = o
    st = eng.stats()
    assert 0.9 <= st["disk_wait_s"] < 10 and st["disk_wait_admissions"] == 0 and st["disk_admission_waits"] == 1
    assert [r.request_id for r in eng.scheduler.waiting] == ["back"]
    gate.set()
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert done["back"].num_cached_tokens >= len(turn2) - 8
    assert [done["back"].outputs[0].token_ids, done["other"].outputs[0].token_ids] == hf_reference(
        tiny_llama, [turn2, other], max_tokens=6)
    eng.check_integrity()
    b.close()


def test_a_page_spilled_in_this_step_is_read_from_the_next_one():
    """The connector (kv/tiers.py) never asks the worker to read a file the step's own plan has
    yet to write: neither for an admission (``ready``) nor as a hint (``prefetch``); from the
    next step on it does."""
    from prefixkv.kv import TierConnector
    from prefixkv.kv.keys import EvictedPage, LowerPage

    class Reads:
        def __init__(self):
            self.asked = []

        def begin_pass(self, has_running):
            pass

        def prefetch(self, keys):
            self.asked.append(list(keys))
            return True

        def wait_ready(self, keys):
            self.asked.append(list(keys))
            return True

        def take_failed(self):
            return []

    tiers = TierConnector(num_host_pages=1, num_disk_pages=4)
    tiers.reads = reads = Reads()
    a, b = (11, 0), (12, 0)
    tiers.save([EvictedPage(3, a, (1, 2))])
    assert tiers.take_plan([]).saves == [(3, 0)]
    tiers.begin_step(False)
    tiers.save([EvictedPage(4, b, (3, 4))])  # b pushes a out of the one slot: a goes to its file
    assert tiers._plan.spills == [(0, a, (1, 2))] and tiers.holds(a, (1, 2))
    hit = [LowerPage(0, 0, a, (1, 2))]
    tiers.prefetch(hit)
    assert not tiers.ready(hit, wait=True) and reads.asked == [] and tiers.num_read_waits == 1
    plan = tiers.take_plan([])
    assert plan.spills == [(0, a, (1, 2))] and plan.saves == [(4, 0)]
    tiers.begin_step(False)
    tiers.prefetch(hit)
    assert tiers.ready(hit, wait=False) and reads.asked == [[a], [a]]
