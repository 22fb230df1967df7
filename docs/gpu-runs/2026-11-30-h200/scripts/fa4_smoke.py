"""FA4 behind torch's varlen kernel, checked before the bench trusts it: activation, then a
forward+backward of knapray's varlen attention against float32 SDPA per sequence."""
import sys
import time

import torch
import torch.nn.functional as F

from knapray.attention import activate_flash_impl, varlen_attention

try:
    from torch.nn.attention import list_flash_attention_impls
    print("torch flash impls:", list_flash_attention_impls())
except ImportError as e:
    print("no flash impl registry:", e)
t0 = time.perf_counter()
try:
    import flash_attn.cute.interface  # noqa: F401
    print("flash_attn.cute.interface imported in %.1f s" % (time.perf_counter() - t0))
except Exception as e:  # noqa: BLE001
    print("FA4 import failed:", type(e).__name__, str(e)[:300])
    sys.exit(1)
impl = activate_flash_impl("cuda")
print("activated:", impl)
if impl is None:
    sys.exit(1)
torch.manual_seed(0)
lens = [1000, 3000, 512]
H, D = 8, 128
q, k, v = (torch.randn(sum(lens), H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
t0 = time.perf_counter()
for backend in ("torch_varlen",):
    out = varlen_attention(q, k, v, cu, max(lens), backend=backend)
    g = torch.randn_like(out)
    out.backward(g)
    torch.cuda.synchronize()
print("first fwd+bwd (compiles FA4's kernels) %.1f s" % (time.perf_counter() - t0))
worst = 0.0
start = 0
qf, kf, vf = (t.detach().float() for t in (q, k, v))
for L in lens:
    s = slice(start, start + L)
    ref = F.scaled_dot_product_attention(*(t[s].transpose(0, 1)[None] for t in (qf, kf, vf)))[0].transpose(0, 1)
    worst = max(worst, float((out[s].float() - ref).norm() / ref.norm()))
    start += L
grads = [float(t.grad.float().norm()) for t in (q, k, v)]
print(f"FA4 forward vs fp32 SDPA: worst relative error {worst:.2e}; grad norms {grads}")
ok = worst < 2e-2 and all(g == g and g > 0 for g in grads)
print("FA4 SMOKE", "PASSED" if ok else "FAILED")
sys.exit(0 if ok else 1)
