"""Diagnose byte differences between the Triton store and the torch reference on a GPU.

Checks the pieces separately on 4M random values: fp32 division (Triton div_rn vs
torch), fp32 -> fp8 casts (Triton vs torch), and the per-token-head quantizer.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _div_cast(x_ptr, s_ptr, y_ptr, q_ptr, c_ptr, N: tl.constexpr):
    o = tl.program_id(0) * N + tl.arange(0, N)
    x = tl.load(x_ptr + o)
    s = tl.load(s_ptr + o)
    y = tl.math.div_rn(x, s)
    tl.store(y_ptr + o, y)
    tl.store(q_ptr + o, tl.minimum(tl.maximum(y, -448.0), 448.0).to(tl.float8e4nv))
    tl.store(c_ptr + o, tl.minimum(tl.maximum(x, -448.0), 448.0).to(tl.float8e4nv))


def main():
    n = 1 << 22
    x = torch.randn(n, device="cuda") * 30
    s = torch.rand(n, device="cuda") * 0.1 + 0.01
    y = torch.empty_like(x)
    q = torch.empty(n, dtype=torch.float8_e4m3fn, device="cuda")
    c = torch.empty_like(q)
    _div_cast[(n // 1024,)](x, s, y, q, c, N=1024)
    yt = x / s
    print("div: differ", int((y != yt).sum()))
    ct = x.clamp(-448, 448).to(torch.float8_e4m3fn)
    d = c.view(torch.uint8) != ct.view(torch.uint8)
    print("cast fp32->e4m3: differ", int(d.sum()), x[d][:5].tolist(), c[d][:5].float().tolist(),
          ct[d][:5].float().tolist())
    qt = yt.clamp(-448, 448).to(torch.float8_e4m3fn)
    d = q.view(torch.uint8) != qt.view(torch.uint8)
    print("div+cast: differ", int(d.sum()), yt[d][:5].tolist(), q[d][:5].float().tolist(), qt[d][:5].float().tolist())


if __name__ == "__main__":
    main()
