"""launch/scaling.py end to end on a tiny target: the data jobs grow to cover the budgets, one EAGLE-3 run per budget
(and the other source at the compare budget) trains on the right prefix, each is evaluated through the decoding loop,
the report is written, and a rerun does no work twice."""

import json
import subprocess
import sys

import datasets
import pytest
from conftest import REPO

from specdrafter.eval import scaling


def test_scaling_curve_runs_end_to_end_and_resumes(tmp_path, tiny_target, monkeypatch):
    rows = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"Tell me a short fact about the number {i}."},
                                             {"from": "gpt", "value": f"The number {i} is {'even' if i % 2 == 0 else 'odd'}, "
                                                                      "and that is a fact worth knowing."}]}
            for i in range(40)]
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "scaling"
    cmd = [sys.executable, str(REPO / "launch" / "scaling.py"), str(REPO / "recipes" / "smollm2-135m-scaling.yaml"),
           f"output_dir={out}", f"target.model={tiny_target}", f"data.prompts={prompts}", "data.exclude=[]",
           "data.max_new_tokens=16", "data.shard_size=4", "data.batch_size=4", "data.min_prompt_tokens=3",
           "data.hidden_states.layer_ids=[0,1,2]", "data.hidden_states.dtype=float32",
           "drafter.eagle.aux_layer_ids=[0,1,2]", "drafter.eagle.draft_vocab_size=256", "drafter.eagle.ttt_steps=2",
           "train.epochs=1", "train.micro_batch_size=2", "train.heldout=2", "train.precision=fp32", "train.max_length=96",
           f"eval.sets=[{prompts}]", "eval.num_prompts=1", "eval.max_new_tokens=6", "eval.temperatures=[0]",
           "inference.dynamic_tree.total_tokens=4", "inference.dynamic_tree.depth=2", "inference.dynamic_tree.top_k=2",
           "scaling.budgets=[120,240]", "scaling.compare_budget=120", "scaling.tokens_per_conversation=10"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "scaling.json").read_text())
    assert sorted(report["runs"]) == ["dataset-120", "dataset-240", "target-120"]
    for name, run in report["runs"].items():
        assert set(run["cells"]) == {"chat|T=0|chain", "chat|T=0|tree"}
        assert all(c["tau"] >= 1 for c in run["cells"].values())
        recipe = (out / name / "recipe.yaml").read_text()
        assert f"data_tokens: {run['budget']}" in recipe and f"data-{run['source']}" in recipe
    sources = {s: datasets.load_from_disk(str(next((out / f"data-{s}" / "shards").glob("shard-*"))))["source"][0]
               for s in ("dataset", "target")}
    assert sources == {"dataset": "dataset", "target": "target"}
    dataset_stats = json.loads((out / "data-dataset" / "stats.json").read_text())
    assert dataset_stats["response_tokens"] >= 240
    # the budgets differ in the data they saw: the larger run trained on more tokens per epoch
    assert report["runs"]["dataset-240"]["tokens_seen"] > report["runs"]["dataset-120"]["tokens_seen"]
    assert (out / "scaling.md").is_file() and (out / "tau_vs_tokens.png").stat().st_size > 0
    assert "dataset-240" in (out / "scaling.md").read_text()

    # A rerun: every step finds its work done. The curve runs again in-process with its commands recorded: it starts
    # no data job (the data covers every budget) and repeats each training and evaluation command of the first run
    # word for word, which the jobs answer with no work (test_train.py's killed-run test reruns a finished training,
    # test_eval_job.py's reruns decode no cell), so the six jobs are not started again to find nothing to do.
    first = [line[len("$ python "):] for line in done.stderr.splitlines() if line.startswith("$ python -m specdrafter.")]
    assert len(first) >= 8 and any(".jobs.data " in line for line in first)
    rerun = []
    monkeypatch.setattr(scaling, "command", lambda module, recipe, overrides, *extra: rerun.append(
        " ".join(["-m", module, recipe, *overrides, *extra])))
    scaling.main(cmd[2:])
    assert rerun == [line for line in first if ".jobs.data " not in line]


def test_the_trend_is_alphas_slope_per_decade_and_its_extrapolation_to_tau_3():
    from specdrafter.eval.scaling import ALPHA_FOR_TAU_3, alpha_trend, trend_lines
    assert ALPHA_FOR_TAU_3 == pytest.approx(0.741271, abs=1e-4)  # the root in [0, 1] of α⁴ + α³ + α² + α − 2 (bisection)
    a, b = alpha_trend([(1e5, 0.30), (1e6, 0.40), (1e7, 0.50)])
    assert (a, b) == (pytest.approx(-0.2), pytest.approx(0.1))
    a, b = alpha_trend([(1e5, 0.30), (1e6, 0.50), (1e7, 0.40)])  # not on a line: the least-squares fit
    assert (a, b) == (pytest.approx(0.1), pytest.approx(0.05))  # x̄ = 6, ȳ = 0.4: b = (−1·−0.1 + 1·0) / 2, a = ȳ − 6b
    assert alpha_trend([(1e5, 0.3)]) is None
    cell = lambda alpha: {"cells": {"mt|T=0|chain": {"alpha": alpha}}}  # noqa: E731
    runs = {"dataset-100000": {"source": "dataset", "budget": 100000, **cell(0.3413)},
            "dataset-1000000": {"source": "dataset", "budget": 1000000, **cell(0.4413)},
            "target-100000": {"source": "target", "budget": 100000, **cell(0.90)}}  # the other source: not on the line
    lines = trend_lines(runs, {"source": "dataset"}, ["mt|T=0"])
    # +0.1 a decade from 0.3413 at 1e5 tokens: four more decades to 0.7413
    assert lines[-1] == "| mt | 0 | +0.100 | 2 | 1.0e+09 |"
    runs["dataset-1000000"] = {"source": "dataset", "budget": 1000000, **cell(0.25)}
    assert trend_lines(runs, {"source": "dataset"}, ["mt|T=0"])[-1].endswith("| never (α does not grow) |")


def test_summary_keeps_each_speedup_kind(tmp_path):
    """summarise() stores a cell's speedup under its kind's keys; the report prints each with its spread."""
    from specdrafter.eval.scaling import summarise, write_scaling_report
    base = {"sweep": False, "set": "mt", "verifier": "chain", "tau": 1.5, "alpha": 0.3}
    cells = [{**base, "temperature": 0.0, "speedup_drift_corrected": 1.2, "speedup_drift_spread": 0.05,
              "speedup_uncorrected": 1.1},
             {**base, "temperature": 1.0, "speedup_median": 1.08, "speedup_range": 0.11,
              "speedup_rounds": [1.0, 1.08, 1.11], "baseline_tokens_per_s": 18.7},
             {**base, "verifier": "tree", "temperature": 0.0, "speedup_median": 0.9, "speedup_range": 0.02,
              "speedup_rounds": [0.89, 0.9, 0.91], "baseline_tokens_per_s": 20.0}]
    (tmp_path / "results.json").write_text(json.dumps({"cells": cells}))
    summary = summarise(tmp_path / "results.json")
    assert summary["mt|T=0|chain"]["speedup_drift_spread"] == 0.05 and "speedup_median" not in summary["mt|T=0|chain"]
    assert summary["mt|T=1|chain"]["speedup_median"] == 1.08 and summary["mt|T=1|chain"]["speedup_range"] == 0.11
    assert summary["mt|T=0|tree"]["speedup_median"] == 0.9
    old = {"tau": 1.4, "alpha": 0.25, "speedup_drift_corrected": 0.66, "speedup_drift_spread": None}
    runs = {"dataset-100": {"source": "dataset", "budget": 100, "step": 5, "cells": summary},
            "dataset-10": {"source": "dataset", "budget": 10, "step": 1, "cells": {"mt|T=1|tree": old}}}
    write_scaling_report({"runs": runs, "settings": {"source": "dataset", "budgets": [10, 100], "epochs": 1, "k": 4}},
                         tmp_path)
    rows = [line for line in (tmp_path / "scaling.md").read_text().splitlines() if line.startswith("| dataset-")]
    assert len(rows) == 4 and rows[1].endswith("| – | 0.66× |")  # no spread recorded
    assert rows[2].endswith("| 1.20× ± 0.05 | 0.90× ± 0.02 |") and rows[3].endswith("| 1.08× ± 0.11 | – |")
