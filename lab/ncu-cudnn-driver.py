#!/usr/bin/env python3
"""lab/ncu-cudnn-driver.py D N CAUSAL: SDPA's cuDNN backend, fp16, FlashAttention-2's shape at head
dim D and length N (batch 16384 / N, heads 2048 / D), three forwards and three backwards
(torch.autograd.grad with a random dO), for Nsight Compute to profile one of each
(lab/gpu-ncu-vs-cudnn.sh). Inputs uniform in [-1, 1), as lab/power-states.py draws them."""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

d, n, causal = int(sys.argv[1]), int(sys.argv[2]), bool(int(sys.argv[3]))
shape = (16384 // n, 2048 // d, n, d)
q, k, v, do = (torch.rand(shape, device="cuda", dtype=torch.float16) * 2 - 1 for _ in range(4))
for t in (q, k, v):
    t.requires_grad_(True)
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    for _ in range(3):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    for _ in range(3):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.autograd.grad(o, (q, k, v), do)
torch.cuda.synchronize()
