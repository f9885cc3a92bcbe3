"""lm-evaluation-harness against ``prefixkv serve`` (issue 41): its ``local-completions`` model scores a
small multiple-choice task (a local dataset file) through completions ``echo`` + ``logprobs``, and agrees
with its ``hf`` model on the same weights: the same choices, every log-likelihood within 1e-9 (float64)."""

from __future__ import annotations

import json

import pytest

from prefixkv import LLM
from prefixkv.async_engine import AsyncEngine
from prefixkv.server.app import BackgroundServer, ServerConfig

TASK = "prefixkv_tiny_mc"
DOCS = [{"question": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0},
        {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
        {"question": "Fire is", "choices": [" hot", " cold", " wet"], "answer": 1}]


def test_local_completions_agrees_with_hf(tiny_llama, tmp_path, monkeypatch):
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(d) for d in DOCS))
    (tmp_path / "task.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n    aggregation: mean\n"
        "    higher_is_better: true\n")
    tasks = TaskManager(include_path=str(tmp_path), include_defaults=False)  # (indexing its own tasks: 20 s)

    def run(model: str, args: dict) -> dict:
        return lm_eval.simple_evaluate(model=model, model_args=args, tasks=[TASK], task_manager=tasks,
                                       log_samples=True, batch_size=1)

    hf = run("hf", {"pretrained": str(tiny_llama), "dtype": "float64", "device": "cpu"})
    llm = LLM(model=str(tiny_llama), dtype="float64", num_kv_blocks=128)
    engine = AsyncEngine(llm.engine)
    with BackgroundServer(engine, ServerConfig("t")) as srv:
        served = run("local-completions", {"base_url": srv.url + "/v1/completions", "model": "t",
                                           "tokenizer_backend": "huggingface", "tokenizer": str(tiny_llama),
                                           "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1})
    engine.close()
    want, got = hf["samples"][TASK], served["samples"][TASK]
    assert [s["doc_id"] for s in got] == [s["doc_id"] for s in want] == list(range(len(DOCS)))
    for w, g in zip(want, got):
        assert len(g["resps"]) == len(DOCS[w["doc_id"]]["choices"])
        for (w_ll, w_greedy), (g_ll, g_greedy) in ((a[0], b[0]) for a, b in zip(w["resps"], g["resps"])):
            assert g_ll == pytest.approx(w_ll, abs=1e-9, rel=0) and g_greedy == w_greedy
        assert g["acc"] == w["acc"]
    assert served["results"][TASK]["acc,none"] == hf["results"][TASK]["acc,none"]
