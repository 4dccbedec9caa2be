"""The τ-vs-target-tokens curve of EAGLE-3 (eval/scaling.py): data, training and evaluation per budget.

    nohup python launch/scaling.py recipes/smollm2-135m-scaling.yaml > scaling.log 2>&1 &

Hours on a laptop CPU: run it in the background; rerunning the same command resumes every step. The report
(scaling.md, tau_vs_tokens.png, scaling.json) is rewritten in output_dir after every evaluated budget.
"""

from specdrafter.eval.scaling import main

if __name__ == "__main__":
    main()
