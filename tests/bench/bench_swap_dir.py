#!/usr/bin/env python3
"""Prints a config's swap directory (the optimizer's nvme_path, else the parameters', else
runs/swap), for the benchmark scripts beside it."""
import json
import sys

z = json.load(open(sys.argv[1])).get('zero_optimization', {})
print(z.get('offload_optimizer', {}).get('nvme_path') or
      z.get('offload_param', {}).get('nvme_path') or 'runs/swap')
