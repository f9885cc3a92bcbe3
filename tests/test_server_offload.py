"""The server keeps tokenizer work off the engine thread and enqueues a request's prompts in one
engine command."""

from __future__ import annotations

import threading

import openai
import pytest

from prefixkv.async_engine import AsyncEngine
from prefixkv.config import CacheConfig, EngineConfig
from prefixkv.engine import LLMEngine
from prefixkv.server.app import BackgroundServer, ServerConfig


@pytest.fixture(scope="module")
def served(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), cache=CacheConfig(block_size=4, num_kv_blocks=512)))
    with BackgroundServer(AsyncEngine(engine), ServerConfig("m")) as srv:
        yield engine, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


def test_chat_template_and_tokenization_run_off_the_engine_thread(served):
    engine, client = served
    tok = engine.tokenizer
    threads = []
    real_template, real_encode = tok.apply_chat_template, tok.encode

    def template(*a, **k):
        threads.append(("template", threading.current_thread().name))
        return real_template(*a, **k)

    def encode(*a, **k):
        threads.append(("encode", threading.current_thread().name))
        return real_encode(*a, **k)

    tok.apply_chat_template, tok.encode = template, encode
    try:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi there"}], max_tokens=2)
        client.completions.create(model="m", prompt="hello", max_tokens=2)
    finally:
        tok.apply_chat_template, tok.encode = real_template, real_encode
    assert {k for k, _ in threads} == {"template", "encode"}
    assert all(name.startswith("prefixkv-tokenize") for _, name in threads), threads


def test_a_batch_of_prompts_enters_one_step(served):
    engine, client = served
    seen = []
    real = engine.step

    def step():
        seen.append(engine.scheduler.num_waiting + engine.scheduler.num_running)
        return real()

    engine.step = step
    try:
        res = client.completions.create(model="m", prompt=[f"prompt number {i}" for i in range(8)], max_tokens=3)
    finally:
        engine.step = real
    assert len(res.choices) == 8
    assert seen[0] == 8  # all eight were queued before the first step that saw any of them
