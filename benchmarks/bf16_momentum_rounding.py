"""Round-to-nearest or stochastic rounding for Adam-mini's bf16 momentum: the error of a bf16 m against a float32 m
after 300 steps of m <- lerp(m, g, 1 - beta1), on 10^6 entries whose gradients are a fixed direction plus unit noise.

    python benchmarks/bf16_momentum_rounding.py
"""

import torch

torch.manual_seed(0)
n = 1_000_000
mean = torch.randn(n) * 0.5  # a persistent gradient direction plus noise


def sr(x):  # stochastic rounding of float32 to bfloat16
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32)
    return ((bits + noise) & -65536).view(torch.float32)


m32 = torch.zeros(n)
rtn = torch.zeros(n)
srm = torch.zeros(n)
for beta1 in (0.9, 0.95):
    m32.zero_()
    rtn.zero_()
    srm.zero_()
    for _ in range(300):
        g = mean + torch.randn(n)
        m32.lerp_(g, 1 - beta1)
        rtn = rtn.lerp(g, 1 - beta1).bfloat16().float()
        srm = sr(srm.lerp(g, 1 - beta1))
    rel = lambda a: ((a - m32).norm() / m32.norm()).item()
    bias = lambda a: ((a - m32).mean() / m32.abs().mean()).item()
    print(
        f"beta1={beta1}: relative error of m after 300 steps: round-to-nearest {rel(rtn):.2e} "
        f"(mean bias {bias(rtn):+.1e}), stochastic {rel(srm):.2e} (mean bias {bias(srm):+.1e})"
    )
