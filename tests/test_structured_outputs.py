"""Structured outputs (issue 18) through llguidance: offline ``SamplingParams(structured_outputs=...)``
and the server's ``response_format`` / ``structured_outputs``. A constrained greedy row is the argmax
over the grammar's allowed tokens at every step (checked against transformers' float64 logits and a
fresh matcher); unconstrained neighbours are untouched; n > 1, preemption, prefix hits and
speculative decoding keep every output valid; bad schemas are a 400 naming the field. The real
SmolLM2 cases (16 concurrent schemas, the openai client's ``parse``) are in test_smollm2.py."""

from __future__ import annotations

import json
import re

import pytest
import torch

from prefixkv import LLM, SamplingParams
from prefixkv.structured_outputs import StructuredOutputsParams

llguidance = pytest.importorskip("llguidance")

# one token per character at most and no free whitespace: a random model finishes these quickly
CODE = {"regex": r"[a-c]{2}-[0-9]{2}"}
PICK = {"choice": ["alpha", "beta", "gamma"]}
SCHEMA = {"type": "object", "properties": {"k": {"enum": ["x", "yy"]}, "n": {"type": "integer", "minimum": 3,
                                                                         "maximum": 7}},
          "required": ["k", "n"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}
PROMPTS = [[5 + (i * 7 + k) % 300 for i in range(9 + 5 * k)] for k in range(6)]


def _valid(kind: dict, text: str) -> bool:
    if "regex" in kind:
        return re.fullmatch(kind["regex"], text) is not None
    if "choice" in kind:
        return text in kind["choice"]
    doc = json.loads(text)
    import jsonschema

    jsonschema.validate(doc, {k: v for k, v in kind["json"].items() if k != "x-guidance"})
    return True


def _greedy(kind: dict, max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=kind, **kw)


@pytest.mark.parametrize("kind", [CODE, PICK, {"json": SCHEMA}], ids=["regex", "choice", "json"])
def test_constrained_greedy_is_argmax_over_allowed_tokens(tiny_llama, kind):
    """float64: at every step the engine's token is the argmax of transformers' logits over the
    tokens a fresh matcher (fed the tokens so far) allows; the text is valid and it stops there."""
    import llguidance.hf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    llm = LLM(model=str(tiny_llama), dtype="float64", num_kv_blocks=128)
    outs = llm.generate(PROMPTS[:3], _greedy(kind))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float64)
    v = hf.config.vocab_size
    tok = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(str(tiny_llama)), n_vocab=v,
                                       eos_token=llm.engine.info.eos_token_ids)
    grammar = llguidance.grammar_from(*StructuredOutputsParams(**kind).source())
    for prompt, out in zip(PROMPTS, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and _valid(kind, c.text), (c.text, c.finish_reason)
        m = llguidance.LLMatcher(tok, grammar)
        ids = list(prompt)
        for t in c.token_ids:
            logits = hf(torch.tensor([ids])).logits[0, -1]
            bits = torch.zeros((v + 31) // 32, dtype=torch.int32)
            m.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
            allowed = torch.tensor([(int(bits[i // 32]) >> (i % 32)) & 1 for i in range(v)], dtype=torch.bool)
            assert t == int(logits.masked_fill(~allowed, float("-inf")).argmax())
            assert m.consume_token(t)
            ids.append(t)
        assert m.is_stopped()


def test_unconstrained_rows_are_unchanged_by_constrained_neighbours(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float64", num_kv_blocks=256)
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain)]
    mixed = llm.generate(PROMPTS, [plain if i % 2 else _greedy(CODE if i % 4 else PICK) for i in range(len(PROMPTS))])
    for i, o in enumerate(mixed):
        if i % 2:
            assert o.outputs[0].token_ids == alone[i]
        else:
            assert _valid(CODE if i % 4 else PICK, o.outputs[0].text)


def test_valid_under_sampling_n4_preemption_prefix_hits_and_speculation(tiny_llama):
    """Sampled n = 4 (a matcher per sample), a KV budget that forces preemption, prompts sharing
    a prefix, n-gram drafting on (constrained rows do not draft): every output valid."""
    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=40, max_num_batched_tokens=32,
              num_speculative_tokens=3)
    llm.engine.check_integrity_each_step = True
    shared = [7] * 24
    kinds = [CODE, PICK, {"json": SCHEMA}]
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=i, n=4, structured_outputs=kinds[i % 3])
              for i in range(6)]
    outs = llm.generate([shared + p for p in PROMPTS], params)
    assert llm.engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert llm.engine.stats()["spec_draft_tokens"] == 0
    for i, o in enumerate(outs):
        assert len(o.outputs) == 4
        for c in o.outputs:
            assert c.finish_reason == "stop" and _valid(kinds[i % 3], c.text), c.text
    assert llm.engine.scheduler.kv.num_used_blocks == 0


def test_stop_strings_and_max_tokens_still_apply(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", num_kv_blocks=64)
    o = llm.generate([PROMPTS[0]], _greedy({"regex": r"[a-c]{40}"}, max_tokens=5))[0].outputs[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 5 and re.fullmatch(r"[a-c]*", o.text)
    o = llm.generate([PROMPTS[0]], _greedy({"regex": r"a-b-c-d"}, stop=["-c"]))[0].outputs[0]
    assert o.finish_reason == "stop" and o.text == "a-b" and o.stop_reason == "-c"


@pytest.mark.parametrize("so, match", [
    ({"regex": "(ab"}, r"structured_outputs\.regex: invalid: .*unclosed group"),
    ({"json": {"type": "nonsense"}}, r"structured_outputs\.json: invalid: Invalid type: nonsense"),
    ({"json": "{"}, r"structured_outputs\.json: not valid JSON"),
    ({"choice": []}, r"structured_outputs\.choice: must be a non-empty list"),
    ({"grammar": "start: x"}, r"structured_outputs\.grammar: invalid"),
    ({"regex": "a", "choice": ["b"]}, r"structured_outputs: set exactly one of .*got regex, choice"),
    ({"xml": "<a/>"}, r"structured_outputs\.xml: unknown field"),
])
def test_bad_structured_outputs_are_value_errors_and_leave_the_engine_working(tiny_llama, so, match):
    llm = LLM(model=str(tiny_llama), dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match=match):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, structured_outputs=so))
    assert llm.engine.num_unfinished == 0
    assert _valid(PICK, llm.generate([PROMPTS[1]], _greedy(PICK))[0].outputs[0].text)


def test_grammars_are_compiled_once(tiny_llama, monkeypatch):
    llm = LLM(model=str(tiny_llama), dtype="float32", num_kv_blocks=64)
    calls = []
    real = llguidance.grammar_from
    monkeypatch.setattr(llguidance, "grammar_from", lambda *a: calls.append(a) or real(*a))
    llm.generate(PROMPTS[:4], _greedy(PICK))
    llm.generate(PROMPTS[:2], _greedy(PICK))
    assert len(calls) == 1


# ---------------------------------------------------------------------------------------------- server
@pytest.fixture(scope="module")
def server(tiny_llama):
    from prefixkv.async_engine import AsyncEngine
    from prefixkv.config import CacheConfig, EngineConfig
    from prefixkv.engine import LLMEngine
    from prefixkv.server.app import BackgroundServer, ServerConfig

    eng = AsyncEngine(LLMEngine(EngineConfig(model=str(tiny_llama), dtype="float32",
                                             cache=CacheConfig(block_size=16, num_kv_blocks=256))))
    with BackgroundServer(eng, ServerConfig("tiny")) as srv:
        yield srv


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    from test_server_errors import call

    status, doc, _ = call(server, "POST", path, {"model": "tiny", "max_tokens": 40, "temperature": 0, **body})
    return status, doc


MSGS = [{"role": "user", "content": "give me json"}]


def test_server_response_format_and_structured_outputs(server):
    schema = {k: v for k, v in SCHEMA.items()}
    status, doc = _post(server, "/v1/chat/completions", {"messages": MSGS, "response_format": {
        "type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}})
    assert status == 200, doc
    assert _valid({"json": SCHEMA}, doc["choices"][0]["message"]["content"])
    assert doc["choices"][0]["finish_reason"] == "stop"
    status, doc = _post(server, "/v1/chat/completions", {"messages": MSGS, "response_format": {"type": "json_object"},
                                                         "max_tokens": 200})
    assert status == 200 and doc["choices"][0]["finish_reason"] in ("stop", "length"), doc
    if doc["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(doc["choices"][0]["message"]["content"]), dict)
    for so, kind in ((CODE, CODE), (PICK, PICK)):
        status, doc = _post(server, "/v1/completions", {"prompt": "abc", "structured_outputs": so})
        assert status == 200 and _valid(kind, doc["choices"][0]["text"]), doc


def test_server_streams_constrained_output_to_the_openai_client(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    chunks = list(client.completions.create(model="tiny", prompt="x", max_tokens=40, temperature=0, stream=True,
                                            extra_body={"structured_outputs": CODE}))
    assert _valid(CODE, "".join(c.choices[0].text for c in chunks if c.choices))
    chunks = list(client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=40, temperature=0,
                                                 stream=True, response_format={"type": "json_schema", "json_schema": {
                                                     "name": "thing", "schema": SCHEMA}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert _valid({"json": SCHEMA}, text)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs.xml"),
    ({"structured_outputs": PICK, "response_format": {"type": "json_object"}}, "structured_outputs"),
])
def test_server_bad_structured_outputs_are_400_naming_the_field(server, body, param):
    status, doc = _post(server, "/v1/chat/completions", {"messages": MSGS, **body})
    assert status == 400, doc
    assert doc["error"]["param"] == param and doc["error"]["type"] == "invalid_request_error", doc
    assert doc["error"]["message"].startswith(param + ": ")
    status, doc = _post(server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 3})
    assert status == 200


def test_constrained_greedy_rows_do_not_draft(tiny_llama, monkeypatch):
    """Speculative decoding is off for constrained rows (their drafts would have to be checked
    against the grammar); a greedy unconstrained neighbour still drafts."""
    from prefixkv.spec_decode import NgramIndex

    monkeypatch.setattr(NgramIndex, "propose", lambda self, tokens, k: [7] * k)  # always a draft
    prompt = [5, 6, 7, 8] * 12
    llm = LLM(model=str(tiny_llama), dtype="float32", num_kv_blocks=128, num_speculative_tokens=3)
    out = llm.generate([prompt], _greedy(CODE))[0].outputs[0]
    assert _valid(CODE, out.text) and llm.engine.stats()["spec_draft_tokens"] == 0
    llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert llm.engine.stats()["spec_draft_tokens"] > 0
