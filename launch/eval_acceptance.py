"""Evaluate a checkpoint (or every checkpoint of a run): acceptance, τ, speed vs the formula; report + plots.

    python launch/eval_acceptance.py recipes/smollm2-135m-eagle3.yaml checkpoint=runs/smollm2-135m/eagle3 [eval.*=...]

`checkpoint=X` is short for eval.checkpoint=X. Rerunning the same command skips the cells already measured.
With eval.engines=[loop,llama.cpp] the newest checkpoint is also served by llama-server and measured there, beside
the loop's cells in the same report (engines/evaluate.py, engines/llamacpp_eval.py).
"""

from specdrafter.engines.evaluate import main

if __name__ == "__main__":
    main()
