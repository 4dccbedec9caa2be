"""The decode CLI over a prompt file (inference.prompts → decode.jsonl): every prompt decoded exactly, prompts at and
past the target's context limit, and a rerun after a kill that cut the last row short."""

import json
import subprocess
import sys

import pytest
import torch
from bench_load import filled_to
from conftest import REPO, tiny_llama_config
from transformers import LlamaForCausalLM

from specdrafter.core.io import SpecdrafterError
from specdrafter.data.chat import user_prompt_ids
from specdrafter.eval.acceptance import cycle_metrics
from specdrafter.inference.decode import acceptance_rate
from specdrafter.jobs.decode import decode_file, file_summary, load_decoder
from specdrafter.jobs.recipe import load_recipe

CONTEXT, NEW, K = 160, 8, 4


@pytest.fixture(scope="module")
def sharp_target(tmp_path_factory, smollm2_tokenizer):
    """An untied, sharpened tiny Llama with a short context (a tied random one only repeats the prompt's last token)."""
    torch.manual_seed(0)
    target = LlamaForCausalLM(tiny_llama_config(len(smollm2_tokenizer), tie_word_embeddings=False,
                                                max_position_embeddings=CONTEXT)).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(10.0)
    folder = tmp_path_factory.mktemp("sharp-target")
    target.save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    return folder, target


def prompt_of_length(tokenizer, n: int) -> str:
    """A user message whose chat-templated prompt is exactly n tokens."""
    text = filled_to(tokenizer, n)
    assert len(user_prompt_ids(tokenizer, text)) == n, "pick another filler word"
    return text


def test_a_prompt_file_is_decoded_exactly_with_the_context_limit_and_resumes(tmp_path, sharp_target, smollm2_tokenizer):
    folder, target = sharp_target
    fits = CONTEXT - NEW - K  # room for max_new_tokens and one draft block of k
    rows = [{"id": f"q{i}", "prompt": f"Question {i}: name a colour and a number."} for i in range(12)]
    rows += [{"id": "at_limit", "prompt": prompt_of_length(smollm2_tokenizer, fits)},
             {"id": "past_limit", "prompt": prompt_of_length(smollm2_tokenizer, fits + 1)}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_recipe(REPO / "recipes" / "smollm2-135m-generate.yaml",
                      [f"target.model={folder}", "drafter.num_layers=1", f"inference.max_new_tokens={NEW}",
                       f"inference.k={K}", f"inference.prompts={prompts}", f"output_dir={tmp_path / 'out'}"])
    totals = decode_file(cfg)
    assert (totals["decoded"], totals["skipped"], totals["prompts"]) == (13, 1, 14)
    out = [json.loads(line) for line in (tmp_path / "out" / "decode.jsonl").read_text().splitlines()]
    assert [r["id"] for r in out] == [r["id"] for r in rows]
    by_id = {r["id"]: r for r in out}
    assert "exceeds the target's context of 160 tokens" in by_id["past_limit"]["skipped"]
    for row in rows[:3] + [rows[12]]:  # greedy speculative decoding = the target's own greedy continuation
        ids = user_prompt_ids(smollm2_tokenizer, row["prompt"])
        reference = target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW, eos_token_id=2,
                                    pad_token_id=2)[0, len(ids):].tolist()
        got = by_id[row["id"]]
        assert got["tokens"] == len(reference) and got["text"] == smollm2_tokenizer.decode(reference, skip_special_tokens=True)
    assert totals["accepted"] < totals["drafted"]  # the 1-layer self-draft is partly rejected: rollback exercised

    path = tmp_path / "out" / "decode.jsonl"  # a kill mid-write: the last row cut short
    text = path.read_text()
    path.write_text(text[: text.rindex("\n", 0, len(text) - 1) + 1] + '{"id": "past_li')
    again = decode_file(cfg)
    assert (again["resumed"], again["decoded"], again["skipped"]) == (13, 0, 1)
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == [r["id"] for r in rows]


def test_the_prompt_file_cli_reports_the_eval_jobs_alpha(tmp_path, sharp_target, smollm2_tokenizer):
    """decode.jsonl's rows, decode_file's totals and the CLI's line give the α that the eval job's cycle_metrics
    computes from the same decode (accepted ÷ draft positions tried), not accepted ÷ drafted."""
    folder, _ = sharp_target
    rows = [{"id": f"q{i}", "prompt": f"Question {i}: count to {i + 3} in words."} for i in range(4)]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_recipe(REPO / "recipes" / "smollm2-135m-generate.yaml",
                      [f"target.model={folder}", "drafter.num_layers=1", f"inference.max_new_tokens={2 * NEW}",
                       f"inference.k={K}", f"inference.prompts={prompts}", f"output_dir={tmp_path / 'out'}"])
    totals = decode_file(cfg)
    out = [json.loads(line) for line in (tmp_path / "out" / "decode.jsonl").read_text().splitlines()]
    decoder = load_decoder(cfg)  # the same greedy decode, prompt by prompt, as the eval job would measure it
    results = [decoder(user_prompt_ids(smollm2_tokenizer, r["prompt"])) for r in rows]
    for row, result in zip(out, results):
        assert row["tokens"] == len(result.tokens) and acceptance_rate(row["accepted"], row["tried"]) == result.alpha
    cycles = [c for r in results for c in r.cycles]
    alpha = cycle_metrics(cycles, totals["tokens"], 1.0, {}, chain=True).alpha
    assert totals["alpha"] == alpha
    assert totals["accepted"] < totals["tried"] < totals["drafted"]  # α ≠ accepted ÷ drafted on this decode
    assert f"α = {alpha:.3f} " in file_summary(totals, str(tmp_path / "out"))


def test_a_missing_or_empty_prompt_file_is_one_line(tmp_path):
    args = [sys.executable, str(REPO / "launch" / "generate.py"), str(REPO / "recipes" / "smollm2-135m-generate.yaml"),
            f"inference.prompts={tmp_path / 'nope.jsonl'}", f"output_dir={tmp_path}"]
    done = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: recipe key 'inference.prompts'")
    (tmp_path / "empty.jsonl").write_text("")
    cfg = load_recipe(REPO / "recipes" / "smollm2-135m-generate.yaml",
                      [f"inference.prompts={tmp_path / 'empty.jsonl'}", f"output_dir={tmp_path}"])
    with pytest.raises(SpecdrafterError, match="holds no prompts|empty"):
        decode_file(cfg)
