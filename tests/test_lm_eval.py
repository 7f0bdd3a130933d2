"""lm-evaluation-harness against `kvloop serve`: its `local-completions` model scores a
multiple-choice task through /v1/completions (echo + logprobs, token-id prompts), and the
per-choice log-likelihoods equal those of lm-eval's own `hf` model on the same weights."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

from kvloop.config import EngineConfig
from kvloop.engine.llm_engine import LLMEngine
from kvloop.server.app import ServerSettings, create_app
from kvloop.server.background import BackgroundServer

QUESTIONS = [
    {"question": "The quick brown fox jumps over the", "choices": [" lazy dog", " moon", " fence"],
     "answer": 0},
    {"question": "def f(x):\n    return", "choices": [" x * 2", " None", " f(x)"], "answer": 0},
    {"question": "Café naïve", "choices": [" 你好", " 12345", " hello world"], "answer": 1},
    {"question": "1 2 3", "choices": [" 4", " 5 6", " x"], "answer": 0},
]


def write_task(tmp: Path) -> Path:
    data = tmp / "mc.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (tmp / "kvloop_mc.yaml").write_text(
        "task: kvloop_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n")
    return tmp


def per_choice_logliks(results: dict) -> list[float]:
    samples = sorted(results["samples"]["kvloop_mc"], key=lambda s: s["doc_id"])
    return [float(resp[0]) for s in samples for resp in s["filtered_resps"]]


@pytest.mark.slow
def test_lm_eval_local_completions_matches_its_hf_model(tiny_model_dir, tmp_path,
                                                        monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    tasks = TaskManager(include_path=str(write_task(tmp_path)))
    engine = LLMEngine(str(tiny_model_dir), EngineConfig(kv_cache_memory="64MiB",
                                                                kv_cache_dtype="fp32"))
    with BackgroundServer(create_app(engine, ServerSettings(model_name="tiny"))) as server:
        ours = simple_evaluate(
            model="local-completions",
            model_args={"model": "tiny", "base_url": f"{server.url}/v1/completions",
                        "tokenizer_backend": "huggingface", "tokenizer": str(tiny_model_dir),
                        "num_concurrent": 1, "max_retries": 1, "batch_size": 4},
            tasks=["kvloop_mc"], task_manager=tasks, log_samples=True)
    theirs = simple_evaluate(
        model="hf", model_args={"pretrained": str(tiny_model_dir), "dtype": "float32"},
        tasks=["kvloop_mc"], task_manager=tasks, log_samples=True, batch_size=1,
        device="cpu")
    got, want = per_choice_logliks(ours), per_choice_logliks(theirs)
    assert len(got) == len(want) == sum(len(q["choices"]) for q in QUESTIONS)
    assert all(v < 0 for v in got) and len(set(got)) == len(got)  # real, distinct scores
    assert got == pytest.approx(want, abs=1e-3)
    assert ours["results"]["kvloop_mc"]["acc,none"] == theirs["results"]["kvloop_mc"]["acc,none"]
