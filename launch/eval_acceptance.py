"""Evaluate a checkpoint (or every checkpoint of a run): acceptance, τ, speed vs the formula; report + plots.

    python launch/eval_acceptance.py recipes/smollm2-135m-eagle3.yaml checkpoint=runs/smollm2-135m/eagle3 [eval.*=...]

`checkpoint=X` is short for eval.checkpoint=X. Rerunning the same command skips the cells already measured.
"""

from specdrafter.eval.job import main

if __name__ == "__main__":
    main()
