"""CPU time (process_time, 1 thread, min of 5) of attention's JVP paths at B*L = 2048 tokens, H=4, D=64, float32:
fastattn-cpu (forward + fused JVP kernel, through torch.func.jvp), its forward, and torch's math-path
SDPA JVP. CPU time rather than wall time: steadier on a shared machine. Run: python bench/jvp_cputime.py
"""
import time, torch, fastattn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
torch.set_num_threads(1)

def cpu_ms(f, n=5):
    f(); best = 1e9
    for _ in range(n):
        s = time.process_time(); f(); best = min(best, time.process_time() - s)
    return best * 1e3

H, D = 4, 64
for L in (512, 1024, 2048):
    B = 2048 // L
    for causal in (False, True):
        g = torch.Generator().manual_seed(L)
        q, k, v, tq, tk, tv = (torch.randn(B, H, L, D, generator=g) for _ in range(6))
        ours = lambda: torch.func.jvp(lambda q, k, v: fastattn.attention(q, k, v, causal=causal, backend="cpu"), (q, k, v), (tq, tk, tv))
        fwd = lambda: fastattn.attention(q, k, v, causal=causal, backend="cpu")
        def math():
            with sdpa_kernel(SDPBackend.MATH):
                return torch.func.jvp(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v), (tq, tk, tv))
        def mathfwd():
            with sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        a, b, c, d = cpu_ms(ours), cpu_ms(fwd), cpu_ms(math), cpu_ms(mathfwd)
        print(f"B{B} L{L} causal={causal}: fastattn-cpu jvp {a:.0f} ms (= {a/b:.2f} x its forward {b:.0f} ms); "
              f"torch math jvp {c:.0f} ms (math fwd {d:.0f}); math/ours {c/a:.2f}x", flush=True)
