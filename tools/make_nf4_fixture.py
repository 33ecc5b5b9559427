#!/usr/bin/env python3
"""Writes tests/fixtures/nf4/reference.safetensors with bitsandbytes' NF4 (QLoRA's 4-bit
NormalFloat) on the CPU, for tests/nf4_test.cc:
  code     [16]  bitsandbytes' NF4 code book (fp32)
  x        [N]   inputs: normal(0, 0.05) with outliers, exact midpoints between code values
                 (scaled by a block's absmax), zeros, and a block of all zeros; N = 64*40 + 24
                 (a partial last block, as bitsandbytes handles one)
  q        [N/2] the packed bytes (two 4-bit indices per byte, the first element high), as F32
  absmax   [41]  each block's max |x| (fp32)
  y        [N]   bitsandbytes' dequantize_4bit(q, absmax) in fp32

Off the hot path, never a dependency of the build: `VENV/bin/python
tools/make_nf4_fixture.py` in a virtual environment (pip install bitsandbytes torch safetensors).
"""
import os

import bitsandbytes
import bitsandbytes.functional as F
import torch
from safetensors.torch import save_file

g = torch.Generator().manual_seed(4)
n = 64 * 40 + 24
x = 0.05 * torch.randn(n, generator=g)
x[::97] *= 20.0  # outliers set their block's absmax
code = F.get_4bit_type("nf4", device="cpu").float()
# Block 3: values exactly at the midpoints between code values (times the block's absmax 1).
mid = (code[:-1] + code[1:]) / 2
x[3 * 64:3 * 64 + 15] = mid
x[3 * 64 + 15] = 1.0
x[5 * 64:6 * 64] = 0.0  # a block of zeros (absmax 0)
x[7 * 64 + 3] = 0.0
q, st = F.quantize_4bit(x, blocksize=64, quant_type="nf4", compress_statistics=False)
y = F.dequantize_4bit(q, st)
out = {"code": code.contiguous(), "x": x.contiguous(), "q": q.reshape(-1).float().contiguous(),
       "absmax": st.absmax.float().contiguous(), "y": y.reshape(-1).float().contiguous()}
d = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "nf4")
os.makedirs(d, exist_ok=True)
save_file(out, os.path.join(d, "reference.safetensors"))
print("bitsandbytes", bitsandbytes.__version__, {k: tuple(v.shape) for k, v in out.items()})
