#!/usr/bin/env python3
"""strata's check on an NVIDIA GPU, in one command: tools/gpu_check.py --help.

The phases live in tools/gpu_check/ (one module per concern); Python 3.9 or newer, the
standard library only (the GPU machine has no network to install anything)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if sys.version_info < (3, 9):
    sys.exit("gpu_check: needs Python 3.9 or newer (this is %d.%d)" % sys.version_info[:2])

from gpu_check.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
