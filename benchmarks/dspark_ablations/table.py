"""The DSpark ablation table from the probes' learning.json files: python table.py OUT_DIR (run.sh's, or
docs/results/dspark-ablations, which holds copies).

Per row: held-out α̂ of draft 1 and the mean of drafts 2–8 (T = 1, 16 held-out conversations), the same with every
conversation's target features swapped for another's (the relative drop says how much the drafter reads the
context), the backbone alone (Markov head off) and its swapped reading, τ from α̂, and the training seconds."""

import json
import sys
from pathlib import Path


def row(name: str, report: dict) -> str:
    last = report["curve"][-1]
    alpha, swapped = last["alpha"], report.get("context_swapped")
    alone, alone_swapped = report.get("backbone_alone"), report.get("backbone_alone_context_swapped")

    def drop(intact, other):
        return f"{1 - other / intact:.0%}" if intact else "–"
    cells = [name, " ".join(report["overrides"][3:]) or "(the recipe)", f"{alpha[0]:.3f}",
             f"{sum(alpha[1:]) / len(alpha[1:]):.3f}",
             f"{swapped[0]:.3f} (−{drop(alpha[0], swapped[0])})" if swapped else "–",
             f"{alone[0]:.3f}" if alone else "– (no Markov head)",
             f"{alone_swapped[0]:.3f} (−{drop(alone[0], alone_swapped[0])})" if alone_swapped else "–",
             f"{last['tau']:.2f}", f"{last['train_seconds']:.0f}"]
    return "| " + " | ".join(cells) + " |"


def main(out: Path) -> None:
    names = [line.split()[0] for line in Path(__file__).with_name("settings.txt").read_text().splitlines() if line.strip()]
    print("| row | settings | α̂ draft 1 | α̂ drafts 2–8 | draft 1, context swapped | backbone alone, draft 1 | "
          "backbone alone, swapped | τ | train s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in names:  # a run folder's NAME/learning.json, or the copies in docs/results/dspark-ablations/NAME.json
        path = next((p for p in (out / name / "learning.json", out / f"{name}.json") if p.is_file()), None)
        if path is not None:
            print(row(name, json.loads(path.read_text())))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/probe37"))
