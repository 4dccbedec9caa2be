"""The eval job's llama.cpp arm (engines/llamacpp_eval.py): a checkpoint served by llama-server beside our loop, in one
results.json and report; a rerun skips the finished cells; a drafter llama.cpp cannot serve is refused before the loop
runs. Random drafters on a tiny target: the arm's mechanics and the T = 0 identity check, not speed. Needs the
llama.cpp build."""

import json
import subprocess
import sys

import pytest
from conftest import RECIPES, REPO, TINY

from specdrafter.core import llamacpp
from specdrafter.core.io import SpecdrafterError
from specdrafter.data.gguf_assets import served_gguf
from specdrafter.engines.evaluate import evaluate
from specdrafter.engines.llamacpp_eval import both_speedups, plan_cells
from specdrafter.eval.report import write_report
from specdrafter.jobs.recipe import load_recipe

pytestmark = pytest.mark.skipif(not llamacpp.installed(), reason="llama.cpp is not built (specdrafter-llamacpp install)")

SMALL = ["eval.sets=[mtbench]", "eval.num_prompts=2", "eval.max_new_tokens=12", "eval.temperatures=[0,1]",
         "eval.k_sweep=[1,2]", "eval.repeats=1"]


def recipe(kind, run, target, *extra):
    return load_recipe(REPO / "recipes" / f"{RECIPES[kind]}.yaml",
                       [f"output_dir={run}", f"target.model={target}", f"drafter.kind={kind}", *TINY, *SMALL,
                        f"eval.checkpoint={run}", *extra])


def test_the_llamacpp_arm_sits_beside_the_loop_in_one_report(drafter_run_of, gguf_target_dir, caplog, tmp_path,
                                                              quick_plan):
    run = drafter_run_of("eagle3", "drafter.eagle.draft_vocab_size=0")
    cfg = recipe("eagle3", run, gguf_target_dir, "eval.engines=[loop,llama.cpp]", "eval.llamacpp.p_min_sweep=[0.5]")
    out = evaluate(cfg)
    data = json.loads((out / "results.json").read_text())
    arm = data["llamacpp"]
    assert arm["spec_type"] == "draft-eagle3" and arm["threads"] == 1 and arm["outtype"] == "f32"
    k = arm["choice"]["k"]
    ids = [c["id"] for c in arm["cells"]]
    assert ids == [c["id"] for c in plan_cells("step-000004", ["mtbench"], [0.0, 1.0], k, [1, 2], arm["max_k"],
                                               arm["choice"]["p_min"], [0.5],
                                               arm["choice"].get("pools_sleep", False))]
    assert [c["p_min"] for c in arm["calibration"]["cuts"]] == [0.3, 0.5, 0.7]
    for c in arm["cells"]:
        assert (c["drafted"] > 0 or c["p_min"] > 0) and c["tau"] >= 1.0 and 0.0 <= c["alpha"] <= 1.0
        assert c["predicted_speedup"] > 0 and c["measured_over_predicted"] > 0
        if c["temperature"] == 0:  # identical, or departing only at a tie (else the job would have failed)
            assert c["exact"] and c["identical"] + len(c["departures"]) == 2
    assert len(data["cells"]) > 0  # the loop's cells, in the same results.json
    report = (out / "report.md").read_text()
    assert "## llama.cpp beside our loop (draft-eagle3" in report and "| loop |" in report
    assert "confidence cut p_min 0.5 at k = 8" in report and "| 8 | 0.5 |" in report  # the swept cut's row
    alone = tmp_path / "llamacpp-only"  # eval.engines=[llama.cpp]: no empty sections of the loop's
    alone.mkdir()
    text = write_report({**data, "cells": [], "baselines": {}}, alone).read_text()
    assert "## llama.cpp beside our loop (draft-eagle3" in text and "## Checkpoint" not in text
    assert "## Target-only baselines" not in text and "new tokens each; target step" not in text
    with caplog.at_level("INFO", logger="specdrafter"):
        evaluate(cfg)  # a rerun measures nothing again
    assert f"({len(ids)} already in" in caplog.text


def test_baselines_run_beside_the_drafter_each_at_its_own_setting(drafter_run_of, gguf_target_dir, quick_plan):
    """eval.llamacpp.baselines: an n-gram mode (no drafter, llama.cpp's sizes) and a draft model users serve, here the
    target's own GGUF drafting for itself (a draft that agrees with the target: its plan's k, all of it accepted at
    T = 0), each prompt alternating with the target alone, T = 0 identical, in the same table."""
    run = drafter_run_of("eagle3", "drafter.eagle.draft_vocab_size=0")
    itself = served_gguf(gguf_target_dir)
    cfg = recipe("eagle3", run, gguf_target_dir, "eval.engines=[llama.cpp]", "eval.temperatures=[0]",
                 "eval.k_sweep=[]", f"eval.llamacpp.baselines=[ngram-mod,{itself}]")
    out = evaluate(cfg)
    data = json.loads((out / "results.json").read_text())
    arm = data["llamacpp"]
    cells = {c.get("baseline"): c for c in arm["cells"]}
    assert any(line.startswith("  beside it, ngram-mod: k=own: ") for line in both_speedups(data))
    assert set(cells) == {None, "ngram-mod", str(itself)}
    mode, draft = cells["ngram-mod"], cells[str(itself)]
    assert mode["k"] is None and mode["predicted_speedup"] is None and mode["exact"] and mode["identical"] == 2
    assert arm["baselines"]["ngram-mod"] == {"spec_type": "ngram-mod", "draft": None, "k": None}
    own = arm["baselines"][str(itself)]
    assert own["spec_type"] == "draft-simple" and draft["k"] == own["k"] == own["choice"]["k"]
    assert draft["alpha"] > 0.9 and draft["exact"] and draft["predicted_speedup"] > 0
    report = (out / "report.md").read_text()
    assert "| ngram-mod | mtbench | 0 | own |" in report and "Arm ngram-mod: llama.cpp's --spec-type ngram-mod" in report
    assert f"the draft model {itself.name} at k = {own['k']}, the best its own plan found" in report


def test_a_baseline_that_is_neither_a_mode_nor_a_file_is_one_line(tmp_path, gguf_target_dir):
    with pytest.raises(SpecdrafterError, match=r"eval.llamacpp.baselines.*'\./ngram-moo' is neither one of llama.cpp's "
                                               r"modes without a drafter \(ngram-simple"):
        recipe("eagle3", tmp_path, gguf_target_dir, "eval.llamacpp.baselines=[./ngram-moo]")


def test_a_drafter_llamacpp_cannot_serve_is_refused_before_the_loop(tmp_path, gguf_target_dir):
    cfg = recipe("medusa", tmp_path, gguf_target_dir, "eval.engines=[loop,llama.cpp]")
    with pytest.raises(SpecdrafterError, match="llama.cpp serves no .*remove llama.cpp from eval.engines"):
        evaluate(cfg)
    assert not (tmp_path / "eval").exists()


def test_the_arm_plans_the_chosen_k_per_cell_and_the_sweep_on_the_first_set():
    cells = plan_cells("step-1", ["mtbench", "gsm8k"], [0, 1], 3, [1, 3, 9], 8)
    assert [(c["set"], c["temperature"], c["k"], c["sweep"]) for c in cells] == [
        ("mtbench", 0.0, 3, False), ("mtbench", 1.0, 3, False), ("gsm8k", 0.0, 3, False), ("gsm8k", 1.0, 3, False),
        ("mtbench", 0.0, 1, True)]  # k = 3 at T = 0 is already a cell; 9 is above the drafter's 8


def test_confidence_cuts_are_cells_at_the_longest_block_and_the_plan_cell_keeps_its_cut():
    cells = plan_cells("step-1", ["mtbench", "gsm8k"], [0], 8, [1], 8, 0.5, [0.5, 0.7])
    assert [(c["set"], c["k"], c["p_min"], c["sweep"]) for c in cells] == [
        ("mtbench", 8, 0.5, False), ("gsm8k", 8, 0.5, False), ("mtbench", 1, 0.0, True), ("mtbench", 8, 0.7, True)]
    assert cells[0]["id"].endswith("|k=8|p_min=0.5") and cells[2]["id"].endswith("|k=1")


def test_a_confidence_cut_outside_0_1_is_one_line(tmp_path):
    with pytest.raises(SpecdrafterError, match="p_min_sweep"):
        load_recipe(REPO / "recipes" / "smollm2-135m-eagle3.yaml", [f"output_dir={tmp_path}",
                                                                     "eval.llamacpp.p_min_sweep=[1.5]"])


def test_the_main_job_refuses_a_bad_override_in_one_line_before_anything_runs(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "launch" / "main_job.py"), "bogus.key=1",
                           f"output_dir={tmp_path}/run"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == ["error: unknown recipe key 'bogus' (valid keys here: output_dir, target, "
                                                "data, drafter, train, inference, eval, scaling)"]
    assert not (tmp_path / "run").exists()
