import time, numpy as np, sys
sys.path.insert(0, '.')
from cpumla import native
sys.path.insert(0, 'tests/kernels')
from test_gguf_types import blocks
rows, cols = 4096, 4096
x = np.random.default_rng(0).standard_normal(cols).astype(np.float32)
def bench(w, nbytes, label):
    y = native.gemv(w, x)
    best = 1e9
    for _ in range(5):
        t = time.perf_counter(); 
        for _ in range(10): native.gemv(w, x, y)
        best = min(best, (time.perf_counter() - t) / 10)
    print(f"{label:8s} {nbytes/best/1e9:6.2f} GB/s  {rows*cols/best/1e9:6.2f} Gw/s")
fmts = sys.argv[1:] or ["q8_0", "q4_0", "q4_k", "q6_k", "q2_k", "iq2_xxs"]
for fmt in fmts:
    raw = blocks(fmt, rows, cols, seed=1)
    bench(native.Weight(raw, fmt), raw.nbytes, fmt)
a = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
q4 = native.quantize(native.Weight(a, "f32"), "q4")
bench(q4, q4.nbytes, "own q4")
