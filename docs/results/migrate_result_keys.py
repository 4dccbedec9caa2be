"""Rewrites the result files that still hold keys of an older format into the current one, so that no reader needs a
fallback for them; a file already current is left as it is, so running it again changes nothing.

    python docs/results/migrate_result_keys.py [FOLDER ...]      (default: docs/results, this file's folder)

Every *.json under the folders:
  - a speedup stored as "speedup" and "speedup_spread" gets its kind's keys (eval/acceptance.py, `row()`): side by side
    ("speedup_median", "speedup_range") in a bench_decode.json row or beside "speedup_rounds", else drift-corrected
    ("speedup_drift_corrected", "speedup_drift_spread"), in results.json cells, scaling.json summaries and
    bench_decode.json rows;
  - a results.json's "settings" without "repeats" gets "repeats": 1, the one value there was;
  - a results.json's measured "machine" without "v_raw" gets v_raw = v, and v_spread {}, target_step_spread 0.0 and
    v_repeats 1 where missing: what the readers assumed for such files, so every number read stays the same;
  - a results.json's checksum of itself ("sha256") is taken again as eval/job.py takes it (core/io.py: json_digest);
    one that does not match already is a damaged file, left as it is.
Files keep their indentation and their key order. Stand-alone (the standard library only).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

SIDE_BY_SIDE = ("speedup_median", "speedup_range")
DRIFT_CORRECTED = ("speedup_drift_corrected", "speedup_drift_spread")
MACHINE_KEYS = ("target_step_s", "target_step_spread", "v_repeats", "v", "v_raw", "v_spread")  # _measure_machine's order


def json_digest(obj) -> str:
    """sha256 of a JSON value, independent of key order and layout: core/io.py's json_digest."""
    canonical = json.loads(json.dumps(obj, ensure_ascii=False))
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def speedup_keys(row: dict, keys: tuple) -> dict:
    """`row` with its "speedup" and "speedup_spread" as `keys` (value, spread) where "speedup" stood; a null speedup
    (none measured) loses both."""
    if "speedup" not in row:
        return row
    value, spread = row["speedup"], row.get("speedup_spread")
    out = {}
    for key, x in row.items():
        if key == "speedup" and value is not None:
            out.update({keys[0]: value, keys[1]: spread})
        elif key not in ("speedup", "speedup_spread"):
            out[key] = x
    return out


def cell_speedup_keys(row: dict) -> dict:
    """A results.json cell or scaling.json summary: side by side when it has its rounds, else drift-corrected."""
    return speedup_keys(row, SIDE_BY_SIDE if "speedup_rounds" in row else DRIFT_CORRECTED)


def current_machine(machine: dict) -> dict:
    """A results.json "machine" with every key eval/job.py:machine_costs reads ({}: not measured yet, as it is)."""
    if not machine:
        return machine
    filled = {"target_step_s": 0.0, "target_step_spread": 0.0, "v_repeats": 1, "v_spread": {},
              "v_raw": machine.get("v_raw") or machine.get("v") or {"1": 1.0}, **machine}
    return {**{key: filled[key] for key in MACHINE_KEYS if key in filled}, **filled}


def migrated(data: dict) -> dict:
    """`data` (one result file) in the current format."""
    if data.get("schema") == 1 and isinstance(data.get("cells"), list):  # an eval job's results.json
        data = {**data, "settings": {**data["settings"], "repeats": data["settings"].get("repeats", 1)},
                "machine": current_machine(data["machine"]), "cells": [cell_speedup_keys(c) for c in data["cells"]]}
        if "sha256" in data:
            data = {**data, "sha256": json_digest({k: x for k, x in data.items() if k != "sha256"})}
    if isinstance(data.get("runs"), dict):  # scaling.json: a summary of each run's cells
        data = {**data, "runs": {name: {**run, "cells": {key: cell_speedup_keys(c) for key, c in run["cells"].items()}}
                                 if isinstance(run, dict) and isinstance(run.get("cells"), dict) else run
                                 for name, run in data["runs"].items()}}
    if isinstance(data.get("rows"), list) and all(isinstance(r, dict) and "arm" in r for r in data["rows"]):
        data = {**data, "rows": [speedup_keys(r, SIDE_BY_SIDE) for r in data["rows"]]}  # bench_decode.json
    return data


def layout(text: str) -> dict:
    """The json.dumps arguments that wrote `text`: its indentation, and whether it escapes non-ASCII."""
    lines = text.strip("\n").splitlines()
    indent = len(lines[1]) - len(lines[1].lstrip(" ")) if len(lines) > 1 else None
    return {"indent": indent, "ensure_ascii": text.isascii()}


def atomic_write(path: Path, text: str) -> None:
    """Write to a temp file in the same folder, then rename it over `path`, keeping its permissions."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def migrate_file(path: Path) -> str:
    """Rewrite `path` in the current format if it is not; returns what was done."""
    text = path.read_text(encoding="utf-8")
    data = json.loads(text)
    if not isinstance(data, dict):
        return "unchanged"
    if "sha256" in data and data["sha256"] != json_digest({k: x for k, x in data.items() if k != "sha256"}):
        return "left as it is: it does not match its checksum (damaged)"
    new = migrated(data)
    if new == data:
        return "unchanged"
    atomic_write(path, json.dumps(new, **layout(text)) + ("\n" if text.endswith("\n") else ""))
    return "rewritten"


def main(argv: list) -> int:
    folders = [Path(a) for a in argv] or [Path(__file__).resolve().parent]
    missing = [str(f) for f in folders if not f.is_dir()]
    if missing:
        print(f"error: no such folder: {', '.join(missing)}", file=sys.stderr)
        return 1
    done = {}
    for path in sorted(p for folder in folders for p in folder.rglob("*.json")):
        done[path] = migrate_file(path)
        if done[path] != "unchanged":
            print(f"{path}: {done[path]}")
    print(f"{sum(x == 'rewritten' for x in done.values())} of {len(done)} JSON files rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
