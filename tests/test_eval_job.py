"""The evaluation job on tiny random Llamas with SmolLM2's tokenizer: the α = 1 − D_TV audit, results.json's schema,
resume after a crash, the report and its plots, answer extraction, prompt sets from files, and bad input."""

import json
import math
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from conftest import tiny_llama_config
from transformers import LlamaForCausalLM

import specdrafter.eval.job as eval_job
from specdrafter.core.io import SpecdrafterError, json_digest
from specdrafter.core.recipe import RecipeError
from specdrafter.data.assets import load_prompt_set
from specdrafter.engines.evaluate import evaluate
from specdrafter.eval.job import answer_accuracy, final_number
from specdrafter.inference.decode import speculative_generate
from specdrafter.inference.proposers import DraftModelProposer
from specdrafter.inference.sampling import SamplingParams
from specdrafter.jobs.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A run directory as training leaves it: two checkpoints of a 1-layer draft model (+ the newest in drafter/)."""
    run = tmp_path_factory.mktemp("run")
    for step, seed in [(2, 1), (4, 2)]:
        torch.manual_seed(seed)
        folder = run / "checkpoints" / f"step-{step:06d}"
        LlamaForCausalLM(tiny_llama_config(len(smollm2_tokenizer), num_hidden_layers=1)).save_pretrained(folder / "drafter")
        smollm2_tokenizer.save_pretrained(folder / "drafter")
        (folder / "trainer_state.json").write_text(json.dumps({"step": step, "drafter": "draft_model", "metrics": {}}))
    return run


def eval_recipe(tiny_target, run_dir, out, *extra):
    return load_recipe(REPO / "recipes" / "smollm2-135m-draft.yaml", [
        f"output_dir={out}", f"target.model={tiny_target}", f"eval.checkpoint={run_dir}", f"eval.output_dir={out}",
        "eval.sets=[mtbench,gsm8k]", "eval.num_prompts=2", "eval.max_new_tokens=8", "eval.temperatures=[0,1]",
        "eval.verifiers=[chain,asd]", "eval.k_sweep=[1,2]", "eval.asd_sweep=[[4,0.25,1]]", "inference.k=3", *extra])


# --------------------------------------------------------------------------------------- α = 1 − D_TV audit
def test_acceptance_matches_one_minus_total_variation_at_t1(tiny_target):
    """Exact sampling accepts position i with probability 1 − D_TV(p_i, q_i): over ~650 tried positions the realised
    α and the mean of 1 − D_TV must agree within 3 standard errors (Bernoulli variance Σ tv(1 − tv); fixed seeds)."""
    target = LlamaForCausalLM.from_pretrained(tiny_target).eval()
    torch.manual_seed(5)
    draft = LlamaForCausalLM(tiny_llama_config(target.config.vocab_size, num_hidden_layers=1)).eval()
    with torch.no_grad():  # make the two distributions differ by a middling amount
        draft.lm_head.weight.copy_(target.lm_head.weight + 0.2 * torch.randn_like(target.lm_head.weight))
    proposer, accepted, tried, expected, variance = DraftModelProposer(draft), 0, 0, 0.0, 0.0
    for seed in range(12):
        r = speculative_generate(target, proposer, [1, 504, 3287 + seed, 314], 60, SamplingParams(1.0), 3,
                                 generator=torch.Generator().manual_seed(seed), record_tv=True)
        for c in r.cycles:
            assert len(c.tv) == min(c.accepted + 1, c.drafted) and c.tv_s > 0
            accepted += c.accepted
            tried += len(c.tv)
            expected += sum(1 - t for t in c.tv)
            variance += sum(t * (1 - t) for t in c.tv)
    assert tried > 600 and 0.3 < accepted / tried < 0.8  # a middling acceptance, not a degenerate one
    z = (accepted - expected) / math.sqrt(variance)
    assert abs(z) < 3, (accepted, expected, z)


# -------------------------------------------------------------------------------------- the job end to end
def test_job_writes_results_report_and_plots_and_resumes(tmp_path, tiny_target, run_dir, monkeypatch):
    out = tmp_path / "eval"
    cfg = eval_recipe(tiny_target, run_dir, out)
    real, calls = eval_job._run_cell, []

    def crash_after_three(*args, **kwargs):
        if len(calls) == 3:
            raise KeyboardInterrupt  # killed mid-run
        calls.append(args[1].id)
        return real(*args, **kwargs)
    monkeypatch.setattr(eval_job, "_run_cell", crash_after_three)
    with pytest.raises(KeyboardInterrupt):
        evaluate(cfg)
    first = json.loads((out / "results.json").read_text())
    assert [c["id"] for c in first["cells"]] == calls  # every finished cell is on disk

    calls.clear()
    monkeypatch.setattr(eval_job, "_run_cell", lambda *a, **k: (calls.append(a[1].id), real(*a, **k))[1])
    evaluate(cfg)
    data = json.loads((out / "results.json").read_text())
    ids = [c["id"] for c in data["cells"]]
    # 2 checkpoints × 2 sets × 2 temperatures × chain, + k sweep {1, 2, auto} + per set: ASD × 2 settings (strict exists)
    assert len(ids) == len(set(ids)) == 8 + 3 + 4
    assert not set(calls) & set(c["id"] for c in first["cells"])  # the rerun skipped the finished cells
    assert data["cells"][:3] == first["cells"]  # ... and left them untouched
    evaluate(cfg)  # nothing left: no cell runs
    assert len(calls) == 15 - 3

    assert data["schema"] == 1 and data["drafter"] == "draft_model"
    assert set(data["machine"]["v"]) == {str(n) for n in range(1, 10)} and data["machine"]["v"]["1"] == 1.0  # up to k_max + 1
    v = [data["machine"]["v"][str(n)] for n in range(1, 10)]  # fitted monotone; the raw medians and spread beside
    assert v == sorted(v) and set(data["machine"]["v_raw"]) == set(data["machine"]["v_spread"]) == set(data["machine"]["v"])
    assert set(data["baselines"]) == {"mtbench|T=0.0", "mtbench|T=1.0", "gsm8k|T=0.0", "gsm8k|T=1.0"}
    for c in data["cells"]:
        assert {"id", "checkpoint", "step", "set", "temperature", "verifier", "k", "tokens", "target_passes",
                "tokens_per_s", "speedup_drift_corrected", "tau", "alpha", "per_position", "mean_tv", "alpha_tv_gap", "c",
                "predicted_speedup", "best_k", "outputs"} <= set(c)
        assert c["tau"] == pytest.approx(c["tokens"] / c["target_passes"], abs=1e-3)
        base = data["baselines"][f"{c['set']}|T={c['temperature']}"]
        assert c["target_step_s"] > 0 and base["target_step_s"] > 0  # the machine's speed at each measurement
        drift = base["target_step_s"] / c["target_step_s"]
        speedup = c["speedup_drift_corrected"]
        assert speedup == pytest.approx(c["tokens_per_s"] / (base["tokens_per_s"] * drift), rel=5e-3, abs=2e-3)
        assert c["speedup_uncorrected"] == pytest.approx(c["tokens_per_s"] / base["tokens_per_s"], rel=5e-3, abs=2e-3)
        spread = speedup * (c["target_step_spread"] + base["target_step_spread"])  # the machine around both
        assert c["speedup_drift_spread"] == pytest.approx(spread, abs=2e-3)
        assert not {"speedup", "speedup_spread", "speedup_median", "speedup_range", "speedup_rounds"} & set(c)
        if c["predicted_speedup"]:
            assert c["measured_over_predicted"] == pytest.approx(speedup / c["predicted_speedup"], abs=1e-3)
        assert len(c["per_position_n"]) == len(c["per_position"]) and c["per_position_n"][0] == c["target_passes"]
        assert 0 <= c["alpha"] <= 1 and c["c"] > 0
        assert len(c["per_position"]) == c["k"] if c["k"] != "auto" else len(c["per_position"]) >= c["k_used"]
        rows = [json.loads(x) for x in (out / c["outputs"]).read_text().splitlines()]
        assert len(rows) == 2 and sum(len(r["tokens"]) for r in rows) == c["tokens"]
        if c["verifier"] == "chain":
            assert c["alpha_tv_gap"] == pytest.approx(c["alpha"] - (1 - c["mean_tv"]), abs=2e-4)
            if c["temperature"] == 0:  # greedy: p and q one-hot, so the identity is exact
                assert c["alpha_tv_gap"] == pytest.approx(0, abs=1e-3)
        if c["verifier"] == "asd":
            assert c["temperature"] == 0 and c["asd_regret"] is not None and c["checkpoint"] == "step-000004"
        assert (c["answer_accuracy"] is not None) == (c["set"] == "gsm8k")
    assert {c["step"] for c in data["cells"]} == {2, 4}
    assert [c["k"] for c in data["cells"] if c["sweep"]] == [1, 2, "auto"]
    auto = next(c for c in data["cells"] if c["k"] == "auto")
    assert 1 <= auto["k_used"] <= 8 and auto["predicted_speedup"] > 0  # where the tuner settled, and its prediction

    report = (out / "report.md").read_text()
    assert "## ASD audit" in report and "## Speedup vs k" in report and "## By checkpoint" in report
    assert "| speedup (drift-corrected) | drift spread | uncorrected |" in report  # the spread beside every speedup
    assert "`speedup_drift_corrected`" in report and "⚠ noisy:" in report  # ... and the legend
    for name in ["acceptance_by_position.png", "by_step.png", "speedup_vs_k.png"]:
        png = (out / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000, name
        assert f"]({name})" in report


def test_one_checkpoint_logged_to_wandb_offline_and_other_settings_refused(tmp_path, tiny_target, run_dir, caplog):
    out = tmp_path / "eval"
    with caplog.at_level("INFO", logger="specdrafter"):
        evaluate(eval_recipe(tiny_target, run_dir, out, "eval.sets=[mtbench]", "eval.temperatures=[0]", "eval.wandb=true",
                             "eval.verifiers=[chain]", "eval.k_sweep=[]", f"eval.checkpoint={run_dir}/checkpoints/step-000002"))
    data = json.loads((out / "results.json").read_text())
    assert [c["id"] for c in data["cells"]] == ["step-000002|mtbench|T=0.0|chain|k=3"]
    (c,) = data["cells"]  # the job's first and last lines: the recipe it saved, the headline and the report
    assert caplog.messages[0] == f"recipe: {out / 'recipe.yaml'}" and (out / "recipe.yaml").is_file()
    assert caplog.messages[-1] == (f"evaluation: 1 cell; step-000002, mtbench T=0 chain: τ {c['tau']:.2f}, "
                                   f"α {c['alpha']:.3f}, speedup {c['speedup_drift_corrected']:.2f}× → {out / 'report.md'}")
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].rglob("*.wandb"))
    with pytest.raises(SpecdrafterError, match="max_new_tokens"):
        evaluate(eval_recipe(tiny_target, run_dir, out, "eval.max_new_tokens=9"))


def test_tree_cells_measure_the_tree_pass(tmp_path, tiny_target, run_dir):
    out = tmp_path / "eval"
    evaluate(eval_recipe(tiny_target, run_dir, out, "eval.sets=[mtbench]", "eval.temperatures=[0,1]", "eval.verifiers=[tree]",
                         "eval.k_sweep=[]", "inference.tree=[[0],[1],[0,0]]",
                         f"eval.checkpoint={run_dir}/checkpoints/step-000004"))
    data = json.loads((out / "results.json").read_text())
    assert [c["verifier"] for c in data["cells"]] == ["tree", "tree"] and "4" in data["machine"]["v"]
    for c in data["cells"]:
        assert c["tree_size"] == 4 and len(c["per_position"]) == 2  # depth 2
        v4 = data["machine"]["v"]["4"]
        assert c["predicted_speedup"] == pytest.approx(c["tau"] / (v4 + c["c"]), rel=2e-3, abs=1e-3)  # stored rounded to 3 places
        assert c["mean_tv"] is None and c["best_k"] is None


def test_repeats_measure_each_cell_side_by_side_with_its_own_baseline(tmp_path, tiny_target, run_dir):
    """eval.repeats = 3: every cell decoded three times, target-only decoding beside it prompt by prompt; its speedup is the
    median of the three ratios and its spread their range; the tokens are those of a single run. An older
    results.json without the knob is refused until docs/results/migrate_result_keys.py rewrites it, then resumes at
    repeats = 1; another value is refused, naming it."""
    args = ("eval.sets=[mtbench]", "eval.temperatures=[0,1]", "eval.verifiers=[chain]", "eval.k_sweep=[]",
            f"eval.checkpoint={run_dir}/checkpoints/step-000004")
    once, thrice = tmp_path / "once", tmp_path / "thrice"
    evaluate(eval_recipe(tiny_target, run_dir, once, *args))
    evaluate(eval_recipe(tiny_target, run_dir, thrice, *args, "eval.repeats=3"))
    single = {c["id"]: c for c in json.loads((once / "results.json").read_text())["cells"]}
    tokens = lambda folder, row: [json.loads(line)["tokens"] for line in (folder / row["outputs"]).open()]  # noqa: E731
    data = json.loads((thrice / "results.json").read_text())
    assert data["settings"]["repeats"] == 3 and len(data["cells"]) == 2
    for c in data["cells"]:
        rounds = c["speedup_rounds"]
        assert len(rounds) == 3 and c["speedup_median"] == sorted(rounds)[1]
        assert c["speedup_range"] == pytest.approx(max(rounds) - min(rounds), abs=2e-3)  # each stored rounded
        assert c["speedup_median"] == pytest.approx(c["tokens_per_s"] / c["baseline_tokens_per_s"], abs=2e-3)
        assert not {"speedup", "speedup_spread", "speedup_drift_corrected", "speedup_uncorrected"} & set(c)
        assert tokens(thrice, c) == tokens(once, single[c["id"]])  # the same decoding, three times
        assert (c["alpha"], c["tau"]) == (single[c["id"]]["alpha"], single[c["id"]]["tau"])
    baselines = json.loads((once / "results.json").read_text())["baselines"]
    assert set(data["baselines"]) == set(baselines) == {"mtbench|T=0.0", "mtbench|T=1.0"}
    for base_id, base in data["baselines"].items():  # target-only decoding beside the cell: the same texts, in order
        assert tokens(thrice, base) == tokens(once, baselines[base_id]) and base["tokens"] == baselines[base_id]["tokens"]
    report = (thrice / "report.md").read_text()
    assert "decoded 3 times" in report and "| speedup (median) | range | predicted |" in report

    old = json.loads((once / "results.json").read_text())
    del old["sha256"], old["settings"]["repeats"]  # as written before eval.repeats existed
    (once / "results.json").write_text(json.dumps({**old, "sha256": json_digest(old)}))
    with pytest.raises(SpecdrafterError, match=r"other settings \(repeats\)"):
        evaluate(eval_recipe(tiny_target, run_dir, once, *args))
    subprocess.run([sys.executable, str(REPO / "docs" / "results" / "migrate_result_keys.py"), str(once)], check=True)
    evaluate(eval_recipe(tiny_target, run_dir, once, *args))  # resumes: nothing to do
    assert json.loads((once / "results.json").read_text())["cells"] == list(single.values())  # not re-measured
    with pytest.raises(SpecdrafterError, match=r"other settings \(repeats\)"):
        evaluate(eval_recipe(tiny_target, run_dir, once, *args, "eval.repeats=2"))
    with pytest.raises(RecipeError, match="'eval.repeats' must be >= 1, got 0"):
        eval_recipe(tiny_target, run_dir, once, *args, "eval.repeats=0")


def test_auto_sized_dynamic_tree_cells(tmp_path, tiny_target, run_dir):
    """A dynamic tree sized every cycle: v(n) measured on the tuner's grid, the mean size reported, and the
    prediction priced at the sizes actually verified (between the cheapest and the whole tree)."""
    out = tmp_path / "eval"
    evaluate(eval_recipe(tiny_target, run_dir, out, "eval.sets=[mtbench]", "eval.temperatures=[0]", "eval.verifiers=[tree]",
                         "eval.k_sweep=[]", "inference.dynamic_tree.total_tokens=10", "inference.dynamic_tree.depth=3",
                         "inference.dynamic_tree.top_k=3", f"eval.checkpoint={run_dir}/checkpoints/step-000004"))
    data = json.loads((out / "results.json").read_text())
    v = {int(n): x for n, x in data["machine"]["v"].items()}
    assert {1, 2, 3, 4, 6, 8, 11} <= set(v)
    (c,) = data["cells"]
    assert c["tree_size"] == 11 and 2 <= c["mean_tree_size"] <= 11
    low, high = (c["tau"] / (x + c["c"]) for x in (max(v.values()), min(v.values())))  # priced at the dearest / cheapest pass
    assert low - 2e-3 <= c["predicted_speedup"] <= high + 2e-3  # (rounded to 3 decimals)
    assert "tree 11" in (out / "report.md").read_text()


def test_decode_benchmark_writes_every_arm(tmp_path, tiny_target, run_dir):
    """A smoke run of the side-by-side benchmark (numbers on tiny models mean nothing; the columns must exist)."""
    import bench_decode
    bench_decode.main(["recipes/smollm2-135m-generate.yaml", f"target.model={tiny_target}", "inference.k=2",
                       "inference.tree=[[0],[1],[0,0]]", "--draft-model", str(run_dir / "checkpoints/step-000004/drafter"),
                       "--sets", "mtbench", "gsm8k", "--prompts", "1", "--max-new-tokens", "6", "--repeats", "2",
                       "--out", str(tmp_path)])
    data = json.loads((tmp_path / "bench_decode.json").read_text())
    arms = [(r["temperature"], r["arm"]) for r in data["rows"]]
    assert arms == [(t, a) for t in (0.0, 1.0) for a in ("target", "hf_assisted", "draft_model_chain", "draft_model_tree")]
    assert data["v"]["1"] == 1.0 and set(data["v_raw"]) == set(data["v_spread"]) == set(data["v"])
    for r in data["rows"]:
        assert len(r["repeats"]) == len(r["speedup_rounds"]) == 2 and r["tokens_per_s"] > 0 and r["speedup_range"] >= 0
        assert r["speedup_median"] == min(r["speedup_rounds"])  # the lower middle of two repeats' speedups
        if r["arm"].startswith("draft_model"):
            assert {"tau", "alpha", "c", "predicted_speedup", "measured_over_predicted"} <= set(r)
    target_row = next(r for r in data["rows"] if r["arm"] == "target")
    assert target_row["speedup_by_set"] == {"mtbench": 1.0, "gsm8k": 1.0}  # per set, over the same set's baseline
    assert all(set(r["speedup_by_set"]) == {"mtbench", "gsm8k"} for r in data["rows"])
    assert "Speedup over target-only on each prompt set" in (tmp_path / "bench_decode.md").read_text()
    assert (tmp_path / "bench_decode.md").read_text().count("\n| ") >= 8
    assert (tmp_path / "bench_decode.png").read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------------------------------------- pieces
def test_report_and_benchmark_flag_a_speedup_within_its_spread(tmp_path):
    """Every speedup is printed with its spread; one whose |speedup − 1| is smaller is marked, with a legend."""
    from bench_decode import markdown

    from specdrafter.eval.report import write_report

    def cell(name, speedup, spread):
        return {"id": name, "checkpoint": "step-000004", "step": None, "set": name, "temperature": 0.0, "verifier": "chain",
                "k": 2, "tree_size": None, "asd": None, "sweep": False, "alpha": 0.3, "tau": 1.3, "tokens_per_s": 10.0,
                "speedup_drift_corrected": speedup, "speedup_drift_spread": spread, "speedup_uncorrected": speedup,
                "per_position": [0.3, 0.2],
                "per_position_n": [10, 3], "outputs": f"outputs/{name}.jsonl"}
    data = {"drafter": "draft_model", "target": "tiny", "settings": {"num_prompts": 2, "max_new_tokens": 8},
            "machine": {"target_step_s": 0.01, "target_step_spread": 0.03, "v": {"1": 1.0, "2": 1.2, "3": 1.2},
                        "v_raw": {"1": 1.0, "2": 1.25, "3": 1.15}, "v_spread": {"1": 0.0, "2": 0.04, "3": 0.05}},
            "baselines": {}, "cells": [cell("noisy", 1.05, 0.08), cell("clear", 1.5, 0.05),
                      cell("unknown", 1.02, None)]}
    report = write_report(data, tmp_path).read_text()
    rows = {}
    for line in report.splitlines():  # the first table's row of each set
        if line.startswith("| "):
            rows.setdefault(line.split(" | ")[0].strip("| "), line)
    assert "| 1.05 | 0.08 ⚠ noisy |" in rows["noisy"] and "| 1.5 | 0.05 |" in rows["clear"]
    assert "| 1.02 |  | 1.02 |" in rows["unknown"]  # no spread recorded: nothing to flag
    assert "⚠ noisy: the speedup's spread is larger than its distance from 1×" in report
    assert "2: 1.20 [raw 1.25, spread 4 %]" in report and "target step 10.0 ms (spread 3 %)" in report

    bench = [{"temperature": 0.0, "arm": "target", "shape": "", "tokens_per_s": 10, "speedup_median": 1.0,
              "speedup_range": 0.0},
             {"temperature": 0.0, "arm": "eagle3_chain", "shape": "k=1", "tokens_per_s": 10.4, "speedup_median": 1.04,
              "speedup_range": 0.09}]
    md = markdown(bench, "header")
    assert "| 1.04 | 0.09 ⚠ noisy |" in md and "| 1.0 | 0 |" in md and "⚠ noisy: the speedup's spread" in md


def test_final_number_and_answer_accuracy(tmp_path):
    assert final_number("She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18") == "18"
    assert final_number("so the total is 1,250.") == "1250"
    assert final_number("no digits here") is None
    outputs = tmp_path / "o.jsonl"
    outputs.write_text(json.dumps({"text": "The answer is 18"}) + "\n" + json.dumps({"text": "I think 7."}) + "\n")
    gsm = [{"reference": ["... #### 18"]}, {"reference": ["... #### 8"]}]
    assert answer_accuracy(outputs, gsm) == 0.5
    assert answer_accuracy(outputs, [{"reference": None}, {"reference": None}]) is None


def test_prompt_sets_from_a_datasets_folder_and_chat_rows(tmp_path):
    folder = tmp_path / "traffic"
    datasets.Dataset.from_list([
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there, who are you?"},
                      {"role": "assistant", "content": "A model."}]},
        {"messages": [{"role": "user", "content": "Name a prime number."}]}]).save_to_disk(str(folder))
    records = load_prompt_set(str(folder))
    assert [r["turns"] for r in records] == [["Hi there, who are you?"], ["Name a prime number."]]
    sharegpt = tmp_path / "sg.jsonl"
    turns = [{"from": "human", "value": "Tell a joke."}, {"from": "gpt", "value": "No."}]
    sharegpt.write_text(json.dumps({"conversations": turns}) + "\n")
    assert load_prompt_set(str(sharegpt))[0]["turns"] == ["Tell a joke."]


# ------------------------------------------------------------------------------------------------ bad input
def test_bad_input_one_line_each(tmp_path, tiny_target, run_dir):
    with pytest.raises(SpecdrafterError, match="does not exist"):
        evaluate(eval_recipe(tiny_target, run_dir, tmp_path, f"eval.checkpoint={tmp_path / 'nope'}"))
    with pytest.raises(RecipeError, match="eval.sets.*'mmlu'"):
        eval_recipe(tiny_target, run_dir, tmp_path, "eval.sets=[mmlu]")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(SpecdrafterError, match="is empty"):
        evaluate(eval_recipe(tiny_target, run_dir, tmp_path, f"eval.sets=[{empty}]"))
    with pytest.raises(SpecdrafterError, match="holds a draft_model drafter.*eagle3"):
        evaluate(eval_recipe(tiny_target, run_dir, tmp_path, "drafter.kind=eagle3"))
    with pytest.raises(RecipeError, match="tree needs inference.tree"):
        eval_recipe(tiny_target, run_dir, tmp_path, "eval.verifiers=[tree]")
    long = tmp_path / "long.jsonl"  # 490 + 8 new tokens + a block of 3 fit in 512; the k sweep's largest does too
    long.write_text(json.dumps({"id": "fits", "prompt": "word " * 470}) + "\n"
                    + json.dumps({"id": "too-long", "prompt": "word " * 520}) + "\n")
    with pytest.raises(SpecdrafterError, match="prompt 'too-long' of eval set 'long' has .* context of 512 tokens"):
        evaluate(eval_recipe(tiny_target, run_dir, tmp_path / "long-eval", f"eval.sets=[{long}]"))
    assert not (tmp_path / "long-eval" / "results.json").exists() or not json.loads(
        (tmp_path / "long-eval" / "results.json").read_text())["cells"]  # refused before any pass
    done = subprocess.run([sys.executable, "launch/eval_acceptance.py", "recipes/smollm2-135m-draft.yaml",
                           f"checkpoint={tmp_path / 'missing'}", f"target.model={tiny_target}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1].startswith("error: checkpoint")
    assert "Traceback" not in done.stderr


def block_run(runs: Path, tiny_target: str, variant: str, **extra) -> Path:
    """runs/<variant>/ as the comparison's training leaves it: a tiny block drafter's checkpoint, its trainer_state
    with its tokens and seconds, then its evaluation (eval/results.json) by the eval job. Returns the checkpoint."""
    from specdrafter.models.block import VARIANTS, BlockDrafter, block_config
    from specdrafter.models.block_folders import save_block_drafter
    target = LlamaForCausalLM.from_pretrained(tiny_target)
    torch.manual_seed(0)
    drafter = BlockDrafter(block_config(target.config, VARIANTS[variant], num_layers=1, block_size=4, aux_layer_ids=[1], **extra))
    folder = runs / variant / "checkpoints" / "step-000002"
    save_block_drafter(drafter, folder / "drafter")
    (folder / "trainer_state.json").write_text(json.dumps({"step": 2, "tokens": 900, "seconds": 3.0, "drafter": variant,
                                                           "metrics": {}}))
    out = runs / variant / "eval"
    cfg = load_recipe(REPO / "recipes" / f"smollm2-135m-{variant}.yaml", [
        f"output_dir={out}", f"target.model={tiny_target}", f"eval.checkpoint={runs / variant}",
        f"eval.output_dir={out}", "eval.sets=[mtbench]", "eval.num_prompts=1", "eval.max_new_tokens=8",
        "eval.temperatures=[0,1]", "eval.k_sweep=[2]", "eval.repeats=1", "inference.k=3",
        "drafter.block.block_size=4", "drafter.block.aux_layer_ids=[1]"])
    evaluate(cfg)
    return folder


@pytest.fixture(scope="module")
def dspark_runs(tmp_path_factory, tiny_target) -> Path:
    """runs/dspark/ (block_run) and runs/bench-dspark/bench_decode.json: the DSpark drafter benchmarked at a fixed
    length, confidence-sized and under ASD."""
    import bench_decode
    runs = tmp_path_factory.mktemp("runs")
    folder = block_run(runs, tiny_target, "dspark", markov_rank=8)
    bench_decode.main(["recipes/smollm2-135m-dspark.yaml", f"target.model={tiny_target}", "inference.k=3",
                       "--dspark", str(folder / "drafter"), "--sets", "mtbench",
                       "--prompts", "1", "--max-new-tokens", "6", "--repeats", "1", "--out", str(runs / "bench-dspark")])
    return runs


def test_a_dspark_checkpoint_through_the_eval_job_and_the_benchmark(dspark_runs):
    """A block drafter goes through the same jobs as every kind: per-position acceptance and the drafts verified per
    cycle in results.json; the benchmark's fixed-length, confidence-sized and ASD arms."""
    cells = json.loads((dspark_runs / "dspark" / "eval" / "results.json").read_text())["cells"]
    chain = [c for c in cells if c["verifier"] == "chain" and c["k"] == 3]
    assert len(chain) == 2 and all(len(c["per_position"]) == 3 and c["mean_drafted"] == 3 for c in chain)
    rows = json.loads((dspark_runs / "bench-dspark" / "bench_decode.json").read_text())["rows"]
    assert [(r["temperature"], r["arm"]) for r in rows] == [
        (0.0, "target"), (0.0, "dspark_chain"), (0.0, "dspark_confidence"), (0.0, "dspark_asd"),
        (1.0, "target"), (1.0, "dspark_chain"), (1.0, "dspark_confidence")]
    assert all(1 <= r["mean_drafted"] <= 3 for r in rows if r["arm"] != "target")


def test_the_comparison_report_checks_each_goal_against_the_runs_reports(dspark_runs, tiny_target, tmp_path):
    """eval/compare.py: the goals table from the runs' own reports: τ ratios from both evaluations (DFlash as the
    baseline here), DSpark's MT-Bench τ, ASD over strict from the benchmark, the training cost from trainer_state;
    a goal without its run says "not measured"; the reports are copied beside the README."""
    from specdrafter.eval import compare
    block_run(dspark_runs, tiny_target, "dflash")
    out = tmp_path / "report"
    compare.main(["--runs", str(dspark_runs), "--drafters", "dflash", "dspark", "--baseline", "dflash",
                  "--candidate", "dspark", "--out", str(out)])
    found = compare.collect(dspark_runs, ["dflash", "dspark"], "dflash", "dspark")
    goals = {g["id"]: g for g in compare.goals(found)}
    dspark, dflash = (compare.main_cells(found["evals"][n]) for n in ("dspark", "dflash"))
    ratios = [c["tau"] / b["tau"] for c in dspark for b in dflash if (b["set"], b["temperature"]) == (c["set"], c["temperature"])]
    assert len(ratios) == 2
    tau_goal = goals["tau_ratio"]
    assert f"lowest {min(ratios):.2f}×" in tau_goal["measured"]
    assert tau_goal["verdict"] == ("**met**" if min(ratios) >= 1.5 else f"missed by {1.5 - min(ratios):.2f}×")
    mt = next(c for c in dspark if c["temperature"] == 0)
    assert goals["tau_mtbench"]["measured"] == f"τ {mt['tau']:.2f}"
    asd = next(r for r in json.loads((dspark_runs / "bench-dspark" / "bench_decode.json").read_text())["rows"]
               if r["arm"] == "dspark_asd")
    assert goals["asd"]["measured"].startswith(f"{asd['vs_strict']:+.1%}")
    assert goals["bench_t0"]["verdict"] == goals["bench_t1"]["verdict"] == "not measured"
    assert goals["training_cost"]["measured"].endswith("1.00× as fast")
    readme = (out / "README.md").read_text()
    assert "| mtbench | 0 |" in readme and "DSpark block drafter ÷ DFlash block drafter τ" in readme
    assert "## Decode benchmark `bench-dspark`" in readme
    training = readme[readme.index("## Training"):].split("\n\n")[1]
    assert [row.split(" | ")[0] for row in training.splitlines()[2:]] == ["| DFlash block drafter", "| DSpark block drafter"]
    assert {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} >= {
        "README.md", "dspark/report.md", "dspark/results.json", "dflash/report.md", "bench-dspark/bench_decode.md",
        "bench-dspark/bench_decode.json"}
    done = subprocess.run([sys.executable, "-m", "specdrafter.eval.compare", "--runs", str(tmp_path / "none"),
                           "--drafters", "dspark", "--baseline", "dspark", "--candidate", "dspark"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.strip() == f"error: --runs {tmp_path / 'none'}: no such folder"
