"""One way from flat settings to an ``EngineConfig`` (engine_args.py ``EngineArgs``): ``LLM(...)``,
the command line and the benchmarks give the same configuration for the same settings, and the
defaults are the config classes' own."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from prefixkv.config import CacheConfig, EngineConfig, SchedulerConfig
from prefixkv.engine_args import EngineArgs, add_engine_args, engine_config_from_args


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(list(argv))


def test_defaults_are_the_configs_own():
    assert EngineArgs().create_engine_config() == EngineConfig()
    assert engine_config_from_args(_parse()) == EngineConfig()


def test_the_command_line_and_keywords_give_one_config():
    cli = engine_config_from_args(_parse(
        "--block-size", "8", "--num-kv-blocks", "99", "--kv-cache-memory", "0.5", "--no-prefix-caching",
        "--kv-host-cache-gb", "0.25", "--kv-disk-cache-dir", "/tmp/x", "--kv-disk-cache-gb", "1",
        "--disable-hybrid-kv-cache-manager", "--max-num-batched-tokens", "64", "--max-num-seqs", "3",
        "--max-admitted-prefill-tokens", "none", "--max-waiting-requests", "7", "--max-wait-steps", "0",
        "--num-speculative-tokens", "2",
        "--stream-interval", "4", "--no-batch-invariant", "--seed", "5", "--generation-config", "vllm"))
    kw = EngineArgs(block_size=8, num_kv_blocks=99, kv_cache_memory_bytes=1 << 29, enable_prefix_caching=False,
                    kv_host_cache_gb=0.25, kv_disk_cache_dir="/tmp/x", kv_disk_cache_gb=1.0,
                    disable_hybrid_kv_cache_manager=True, max_num_batched_tokens=64, max_num_seqs=3,
                    max_admitted_prefill_tokens=None, max_waiting_requests=7, max_wait_steps=0,
                    num_speculative_tokens=2, stream_interval=4, batch_invariant=False, seed=5,
                    generation_config="vllm").create_engine_config()
    assert cli == kw
    assert kw.cache == CacheConfig(block_size=8, num_kv_blocks=99, kv_cache_memory_bytes=1 << 29,
                                   enable_prefix_caching=False, host_cache_bytes=1 << 28, disk_cache_dir="/tmp/x",
                                   disk_cache_bytes=1 << 30, disable_hybrid_kv_cache_manager=True)
    assert kw.scheduler == SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=3, max_admitted_prefill_tokens=None,
                                           max_waiting_requests=7, max_wait_steps=0, num_speculative_tokens=2,
                                           stream_interval=4)


def test_every_flag_is_a_field():
    """Each engine flag lands in the EngineArgs field of its name (none is dropped on the way)."""
    dests = {a.dest for a in argparse.ArgumentParser()._actions}
    p = argparse.ArgumentParser()
    add_engine_args(p)
    flags = {a.dest for a in p._actions} - dests
    assert flags <= {f.name for f in dataclasses.fields(EngineArgs)}, flags - {f.name for f in dataclasses.fields(EngineArgs)}


def test_a_bad_value_or_an_unknown_keyword_is_named(tiny_llama):
    from prefixkv import LLM

    with pytest.raises(ValueError, match="^block_size:"):
        EngineArgs(block_size=0).create_engine_config()
    for bad in (-1, 1.5, "0", True):
        with pytest.raises(ValueError, match="^max_wait_steps: must be an int >= 0"):
            EngineArgs(max_wait_steps=bad).create_engine_config()
    with pytest.raises(TypeError, match="blok_size"):
        LLM(model=str(tiny_llama), blok_size=4)
