"""Conformance run: do the engines' own loaders read our exports unchanged? Not part of the test suite.

    python launch/conformance.py [--out runs/conformance] [--reinstall]

The venv, the tiny drafters, their exports and the engines' checks are export/conformance.py's.
"""

from specdrafter.export.conformance import main

if __name__ == "__main__":
    main()
