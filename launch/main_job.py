"""The README's main job in one command: data, training, evaluation in our loop and in llama.cpp, both speedups.

    python launch/main_job.py [key=value ...] [--serve] [--help]

The steps, and what each writes: engines/main_job.py (or --help). Each resumes: rerun the command after a kill.
"""

from pathlib import Path

from specdrafter.engines.main_job import main

if __name__ == "__main__":
    main(Path(__file__).resolve().parents[1])
