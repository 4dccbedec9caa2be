"""Serve a trained drafter in llama.cpp's llama-server with the block length the cost model picks on this machine
(or the target alone, saying why, when no block length pays).

    python launch/serve_llamacpp.py DRAFTER [--target-gguf T.gguf] [--k N] [--port 8080] [--threads 1] [--plan-only]

The same command is installed as `specdrafter-serve`; see docs/llamacpp.md.
"""

from specdrafter.engines.serve import main

if __name__ == "__main__":
    main()
