"""Python face of the kernel library (cffi, API mode).

- library: loading it, the implementation it runs (CPUMLA_ISA), threads, errors, CPU and build facts;
- weight: a checkpoint tensor described for the kernels without a copy (Weight);
- kernels: numpy-friendly wrappers of each kernel, every argument checked;
- model: routers, expert tables and vectors of a model's native description;
- sample: the native sampler.

The runtime's per-token path calls `lib` directly with preallocated buffers (the model's native
state); these wrappers serve tests, benchmarks and load-time work.
"""

from cpumla.native.kernels import (  # noqa: F401
    cache_store,
    dequant,
    gemm,
    gemm_f32act,
    gemv,
    head_gemv,
    head_gemv_t,
    mla_attention,
    mla_mha,
    quantize,
    read_probe,
    rmsnorm,
    rope,
    softmax,
    swiglu,
    topk,
)
from cpumla.native.library import (  # noqa: F401
    DTYPES,
    FORMAT_KERNELS,
    GGUF_FORMATS,
    ISAS,
    KERNELS,
    MAX_THREADS,
    QBLOCK,
    QUANT_FORMATS,
    available_isas,
    build_info,
    built_isas,
    check,
    cpu_features,
    cpu_name,
    decode_operands,
    ensure_init,
    ffi,
    fptr,
    gemv_prefetch,
    get_threads,
    init,
    isa,
    isa_for_features,
    kernel_formats,
    kernel_impl,
    last_error,
    lib,
    set_gemv_prefetch,
    set_threads,
    vptr,
)
from cpumla.native.model import ROUTE_METHODS, Experts, Router, format_of, set_vec  # noqa: F401
from cpumla.native.weight import F32, Weight, aligned_copy, as_weight  # noqa: F401
