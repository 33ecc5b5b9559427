#!/usr/bin/env python3
"""Prints what a PEFT adapter directory holds as a pair: "r<R>" when adapter_config.json's r is
the rank of every lora_A tensor in adapter_model.safetensors, "none" when neither file is there,
else what is mixed. For the kill tests of `strata export --adapter` (hardening3_cli_test.sh,
crash_test.sh).

usage: adapter_pair.py DIR
"""
import json
import os
import struct
import sys

d = sys.argv[1]
c, w = d + "/adapter_config.json", d + "/adapter_model.safetensors"
if not os.path.exists(c) and not os.path.exists(w):
    sys.exit(print("none"))
if not (os.path.exists(c) and os.path.exists(w)):
    sys.exit(print("one file of two"))
r = json.load(open(c))["r"]
with open(w, "rb") as f:
    h = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
ranks = sorted({v["shape"][0] for k, v in h.items() if k.endswith("lora_A.weight")})
print(f"r{r}" if ranks == [r] else f"mixed: config r {r}, weights of rank {ranks}")
