"""docs/results/migrate_result_keys.py: the committed result files are in the current format, and a file in the old
one reads, once rewritten, exactly as the readers' old fallbacks read it."""

import json
import runpy
import shutil

from conftest import REPO

from specdrafter.core.io import json_digest
from specdrafter.eval.acceptance import DriftCorrectedSpeedup, SideBySideSpeedup, speedup_of
from specdrafter.eval.job import machine_costs

SCRIPT = REPO / "docs" / "results" / "migrate_result_keys.py"
migrate = runpy.run_path(str(SCRIPT))


def test_every_committed_result_file_is_in_the_current_format(tmp_path):
    copy = shutil.copytree(REPO / "docs" / "results", tmp_path / "results")
    assert migrate["main"]([str(copy)]) == 0
    changed = [p.name for p in copy.rglob("*.json")
               if p.read_bytes() != (REPO / "docs" / "results" / p.relative_to(copy)).read_bytes()]
    assert changed == []
    for path in (REPO / "docs" / "results").rglob("*.json"):
        assert '"speedup":' not in path.read_text() and '"speedup_spread":' not in path.read_text(), path


def test_an_old_results_json_is_rewritten_once_with_the_numbers_it_had(tmp_path):
    cells = [{"id": "a", "tau": 1.5, "speedup": 1.2, "speedup_spread": 0.05, "speedup_uncorrected": 1.1, "k": 3},
             {"id": "b", "tau": 1.4, "speedup": 1.08, "speedup_spread": 0.11, "speedup_rounds": [1.0, 1.08, 1.11],
              "baseline_tokens_per_s": 18.7},
             {"id": "c", "tau": 1.3, "speedup": None, "speedup_spread": None}]
    data = {"schema": 1, "settings": {"num_prompts": 2}, "machine": {"target_step_s": 0.01, "v": {"1": 1.0, "2": 1.3}},
            "cells": cells}
    path = tmp_path / "eval" / "results.json"
    path.parent.mkdir()
    path.write_text(json.dumps({**data, "sha256": json_digest(data)}, indent=2) + "\n")
    damaged = tmp_path / "damaged.json"
    damaged.write_text(json.dumps({**data, "sha256": "0" * 64}, indent=1))
    bench = tmp_path / "bench_decode.json"
    bench.write_text(json.dumps({"repeats": 1, "rows": [{"arm": "target", "speedup": 1.0, "tokens_per_s": 9.0}]}))

    assert migrate["main"]([str(tmp_path)]) == 0
    text = path.read_text()
    new = json.loads(text)
    assert text == json.dumps(new, indent=2) + "\n"  # its layout kept
    assert new.pop("sha256") == json_digest(new)  # eval/job.py reads it as sound
    assert new["settings"] == {"num_prompts": 2, "repeats": 1}
    assert machine_costs(new["machine"]).v_raw == {1: 1.0, 2: 1.3} and new["machine"]["v_spread"] == {}
    a, b, c = new["cells"]
    assert list(a) == ["id", "tau", "speedup_drift_corrected", "speedup_drift_spread", "speedup_uncorrected", "k"]
    assert speedup_of(a) == DriftCorrectedSpeedup(1.2, 0.05, 1.1)
    assert speedup_of(b) == SideBySideSpeedup(1.08, 0.11, [1.0, 1.08, 1.11], 18.7)
    assert speedup_of(c) is None and list(c) == ["id", "tau"]
    assert json.loads(bench.read_text())["rows"] == [{"arm": "target", "speedup_median": 1.0, "speedup_range": None,
                                                      "tokens_per_s": 9.0}]
    assert json.loads(damaged.read_text())["cells"] == cells  # not its own checksum: left for the job to move aside

    before = {p: p.read_bytes() for p in tmp_path.rglob("*.json")}
    assert migrate["main"]([str(tmp_path)]) == 0
    assert {p: p.read_bytes() for p in tmp_path.rglob("*.json")} == before  # once only
