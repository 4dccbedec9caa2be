"""Regenerate training conversations with the target (and optionally cache its hidden states).

    python launch/generate_data.py recipes/smollm2-135m-data.yaml [key=value ...] [--print-config]
"""

from specdrafter.jobs.data import main

if __name__ == "__main__":
    main()
