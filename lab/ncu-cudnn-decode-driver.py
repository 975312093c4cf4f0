#!/usr/bin/env python3
"""lab/ncu-cudnn-decode-driver.py BATCH KV_LEN: SDPA's cuDNN backend on issue 46's decoding shape
(fp16, d = 128, 32 query heads over 8 K/V heads, enable_gqa=True, q_len 1), four calls, for Nsight
Compute to profile one (lab/gpu-ncu-decode-vs-cudnn.sh)."""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

b, n = int(sys.argv[1]), int(sys.argv[2])
q = torch.rand(b, 32, 1, 128, device="cuda", dtype=torch.float16) * 2 - 1
k = torch.rand(b, 8, n, 128, device="cuda", dtype=torch.float16) * 2 - 1
v = torch.rand_like(k) * 2 - 1
with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
    for _ in range(4):
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
torch.cuda.synchronize()
