"""CLI faces of batching: --prompts-file, --n and beam search flags, JSON shapes."""

from __future__ import annotations

import json

import pytest

from kvloop import LLM, SamplingParams
from kvloop.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_prompts_file_json_one_line_per_prompt_in_order(tiny_model_dir, tmp_path, capsys):
    prompts = ["The quick brown fox", "def f(x):", "1 2 3 4", "Caf\u00e9"]
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(prompts) + "\n")
    code, out, _ = run(capsys, "generate", "--prompts-file", str(f), "--json",
                       "--model", str(tiny_model_dir), "--max-tokens", "6", "--ignore-eos")
    assert code == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == len(prompts)
    llm = LLM(str(tiny_model_dir))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for obj, prompt in zip(lines, prompts, strict=True):
        assert obj["token_ids"] == llm.generate(prompt, params)[0].outputs[0].token_ids


def test_beams_json_outputs_best_first_with_scores(tiny_model_dir, capsys):
    code, out, _ = run(capsys, "generate", "hello", "--json", "--model", str(tiny_model_dir),
                       "--num-beams", "3", "--num-return-sequences", "2", "--max-tokens", "5",
                       "--early-stopping", "true")
    assert code == 0
    obj = json.loads(out)
    outs = obj["outputs"]
    assert len(outs) == 2 and all({"text", "token_ids", "finish_reason", "score"} <= set(o)
                                  for o in outs)
    assert outs[0]["score"] >= outs[1]["score"]


def test_n_samples_json(tiny_model_dir, capsys):
    code, out, _ = run(capsys, "generate", "hello", "--json", "--model", str(tiny_model_dir),
                       "--n", "3", "--temperature", "1", "--seed", "4", "--max-tokens", "5")
    assert code == 0
    assert len(json.loads(out)["outputs"]) == 3


def test_prompt_and_prompts_file_are_exclusive(capsys):
    code, _, err = run(capsys, "generate")
    assert code == 2 and err.startswith("kvloop: error:") and "--prompts-file" in err


def test_missing_prompts_file(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "--prompts-file", str(tmp_path / "nope.txt"))
    assert code == 2 and "cannot read --prompts-file" in err
