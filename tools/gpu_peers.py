#!/usr/bin/env python3
"""DeepSpeed and its dependencies as wheels (and libaio) for a GPU machine without network,
the comparison tools/gpu_check.py's deepspeed phase runs there.

  tools/gpu_peers.py pack [--dir DIR]     here (network): download and build the wheels into
                                          DIR (default build-gpu-bundle/peers), then verify
  tools/gpu_peers.py verify [--dir DIR]   here: install DIR's wheels with no index into a
                                          throwaway venv and check every requirement is met

The module is tools/gpu_check/peers_bundle.py; Python 3.9 or newer, the standard library only."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_check.peers_bundle import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
