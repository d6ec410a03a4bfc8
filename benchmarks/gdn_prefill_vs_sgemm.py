"""The chunked GDN op's prefill rate (T = 4096, one row, Hv = 8, Hk = 4, Dk = Dv = 128, fp32, one thread) against
numpy's sgemm (OpenBLAS) and torch.mm on 2048 x 2048 fp32 matrices, in one run: issue 25's target is at least
half the machine's dense fp32 matmul rate, counting 7 Dk Dv multiply-adds per token and value head.
Run it with OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE unset (``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE``), so
that OpenBLAS picks its own kernel; needs threadpoolctl."""
import time, numpy as np, torch, threadpoolctl
torch.set_num_threads(1)
from hebrus_torch.gdn.chunked import chunk_gated_delta_rule_slots
a = np.random.rand(2048, 2048).astype(np.float32); b = np.random.rand(2048, 2048).astype(np.float32)
with threadpoolctl.threadpool_limits(1):
    a @ b
    best = min((lambda t0: (a @ b, time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(5))
print("numpy", threadpoolctl.threadpool_info()[0].get("internal_api"), threadpoolctl.threadpool_info()[0].get("architecture"), f"{2048**3/best/1e9:.1f} GMAC/s")
ta, tb = torch.from_numpy(a), torch.from_numpy(b)
ta @ tb
best_t = min((lambda t0: (ta @ tb, time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(5))
print(f"torch.mm {2048**3/best_t/1e9:.1f} GMAC/s")
T, hk, hv, D = 4096, 4, 8, 128
g = torch.Generator().manual_seed(0)
q = torch.randn(T, hk, D, generator=g); k = torch.randn(T, hk, D, generator=g); v = torch.randn(T, hv, D, generator=g)
gg = -torch.rand(T, hv, generator=g) * 0.1; beta = torch.rand(T, hv, generator=g)
cu = torch.tensor([0, T], dtype=torch.int32); sp = torch.tensor([0]); pool = torch.zeros(1, hv, D, D); slots = torch.tensor([0], dtype=torch.int32)
chunk_gated_delta_rule_slots(q, k, v, gg, beta, cu, sp, pool, slots)
ts = []
for _ in range(3):
    pool.zero_(); t0 = time.perf_counter(); chunk_gated_delta_rule_slots(q, k, v, gg, beta, cu, sp, pool, slots); ts.append(time.perf_counter() - t0)
work = 7 * D * D * T * hv
print(f"chunked {min(ts)*1e3:.0f} ms = {work/min(ts)/1e9:.1f} GMAC/s -> {work/min(ts)/(2048**3/best):.2f} of numpy, {work/min(ts)/(2048**3/best_t):.2f} of torch.mm")
