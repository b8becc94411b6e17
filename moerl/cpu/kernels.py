"""CPU kernels of an engine's fp32 or bf16 decode step: the routed experts' GEMMs from prepacked
weights, attention read from the paged KV cache in place, and RMSNorm in one call.

At decode's shapes (a few rows per expert, an expert's weight of a MiB) a grouped GEMM is bound by streaming the
weights, and MKL's sgemm, blocked for large GEMMs, streams them at a fraction of the rate a plain read does. The
expert kernel reads each expert's weight once per step, panel by panel, in the order it is stored: the weight
[E, K, N] packed once into panels [E, N / NT, K, NT] (NT columns, two CPU vectors), the rows of a group kept in
registers against each panel. For the gate-up projection each panel holds VW gate columns then the matching VW up
columns, so the activation (SiLU(gate) * up) and the routing weight are applied as the panel's result is stored:
the [rows, 2I] product never reaches memory. The packed copy is kept beside the parameter (``packed_weight``) and
made again when the parameter changes (a weight sync's ``copy_`` bumps its version): an engine's experts take twice
their memory for it, which is why only an engine's own model packs (``moerl.cpu.experts.KernelExperts``).

The attention kernel (``moerl.engine.kv_cache.StepView.attend``) computes a decode query's scores, softmax (with
GPT-OSS's sinks and a sliding window) and value sum straight from the head-major pools through the block table,
where the torch path gathers every visible key and value into new tensors first.

Weights, pools and results may be fp32 or bf16 (bf16 widened exactly in the vector lanes, results narrowed with
round-to-nearest-even); the arithmetic is fp32 throughout, so a bf16 step reads half the bytes of an fp32 one.

LoRA slots join both: ``moe_decode`` adds the experts' adapter deltas inside its GEMMs and sum, ``lora_add`` a
linear layer's in one call (their factors kept in fp32 beside the adapter, ``kept_copy``).

The kernels are C (``kernels.c``; GCC vector extensions: AVX-512, AVX2 or 128-bit vectors, whatever ``-march=native``
gives),
built by the host's C compiler on first use into inductor's cache directory (which a compiled graph needs as well),
and run on torch's own OpenMP threads. Without a compiler, or on a machine where they do not build, ``kernel()`` is
None and the engine keeps torch's ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from moerl.model.grouped import Groups

SOURCE = (Path(__file__).parent / "kernels.c").read_text()  # the kernels, C

KINDS = {torch.float32: 0, torch.bfloat16: 1}  # the kernels' weight and cache dtypes, as their flag
_lib: ctypes.CDLL | None | bool = False  # False: not built yet; None: it does not build here
_bf16_dot: bool | None = None  # bf16_dot(), asked once
build_error = ""  # the compiler's complaint where it ran and failed (tests/test_engine.py shows it)


def kernel() -> ctypes.CDLL | None:
    """The built kernel (built on first use, kept on disk by its source, compiler and CPU), or None where it does
    not build (no C compiler, or not a CPU it compiles for) or is switched off (``MOERL_CPU_KERNELS=0``: the whole
    CPU backend, its engine's and its trainer's ops, off; torch's ops run, to compare or to rule the kernels out)."""
    global _lib, build_error
    if _lib is False:
        off = os.environ.get("MOERL_CPU_KERNELS", "1") == "0"
        _lib = None if off else _build()
        build_error = "switched off (MOERL_CPU_KERNELS=0)" if off else build_error
    return _lib


def _build() -> ctypes.CDLL | None:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        return None
    # MOERL_KERNEL_FLAGS: more of gcc's flags, e.g. "-mno-amx-tile" builds an AMX CPU's kernels as a CPU with
    # AVX512-BF16 and no AMX runs them (tests/test_packed.py), "-mno-avx512f" as an AVX2 CPU does
    flags = [
        "-O3",
        "-march=native",
        "-fopenmp",
        "-shared",
        "-fPIC",
        *shlex.split(os.environ.get("MOERL_KERNEL_FLAGS", "")),
    ]
    cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    tag = hashlib.sha256("\0".join([SOURCE, cc, *flags, _cpu_flags(cpu)]).encode()).hexdigest()[:16]
    lib = Path(cache_dir()) / "moerl_kernels" / f"decode_kernels_{tag}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as d:
            src, out = Path(d) / "packed.c", Path(d) / "packed.so"
            src.write_text(SOURCE)
            done = subprocess.run([cc, *flags, str(src), "-o", str(out)], capture_output=True, text=True)
            if done.returncode:
                global build_error
                build_error = done.stderr[-4000:]
                return None
            os.replace(out, lib)  # whole or absent: another process may be building it too
    # loaded after torch, so the kernel's OpenMP is torch's own runtime (one pool of threads, not two)
    built = ctypes.CDLL(str(lib))
    built.moerl_moe_work.restype = ctypes.c_int64
    return built


def bf16_dot() -> bool:
    """Whether bf16 experts (``moe_decode``) and projections (``bf16_linear``) run on the CPU's bf16 dot products:
    AMX's tiles (the kernel built for a CPU with AMX-BF16, Linux granting this process the tile state) or, on a CPU
    with AVX512-BF16 and no AMX (AMD Zen 4 and later), vdpbf16ps on the same panels. ``MOERL_BF16_DOT=0`` keeps the fp32
    vector FMAs on widened rows (as an AVX2 or AVX-512 CPU without bf16 runs)."""
    global _bf16_dot
    if _bf16_dot is None:
        lib = kernel()
        _bf16_dot = lib is not None and os.environ.get("MOERL_BF16_DOT", "1") != "0" and bool(lib.moerl_bf16_dot())
    return _bf16_dot


def _cpu_flags(cpuinfo: str) -> str:
    """The CPU's feature flags (``-march=native`` builds for them: another CPU gets its own build)."""
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            return line
    return ""


def vector_width() -> int:
    """Floats in one of the kernel's vectors (VW): a panel is 2 VW columns."""
    return kernel().moerl_panel_vector()


def packs(w: torch.Tensor, gate_up: bool) -> bool:
    """Whether weight ``w`` [E, K, N] (fp32 or bf16, on the CPU) fits the kernel's panels: N a multiple of a panel,
    for a gate-up weight each half (gate, up) a multiple of a vector, and for bf16 K even (its panels hold K-pairs)."""
    if kernel() is None or w.dtype not in KINDS or w.device.type != "cpu" or w.dim() != 3:
        return False
    vw = vector_width()
    pairs = w.dtype != torch.bfloat16 or w.shape[1] % 2 == 0
    return pairs and w.shape[2] % (2 * vw) == 0 and (not gate_up or (w.shape[2] // 2) % vw == 0)


def _panel_view(w: torch.Tensor, gate_up: bool) -> torch.Tensor:
    """``w`` [E, K, N] seen in its panels' order, [E, N / NT, K, NT] (a gate-up weight's as [E, N / NT, K, 2, VW]:
    the gate's VW columns of a range, then the up's): a view where ``w`` is contiguous. A bf16 weight's panels hold
    K-pairs, [E, N / NT, K / 2, NT, 2]: each column's two K rows side by side (AMX's layout of a weight tile)."""
    e, k, n = w.shape
    vw = vector_width()
    if w.dtype == torch.bfloat16:
        if gate_up:
            return w.reshape(e, k // 2, 2, 2, n // (2 * vw), vw).permute(0, 4, 1, 3, 5, 2)
        return w.reshape(e, k // 2, 2, n // (2 * vw), 2 * vw).permute(0, 3, 1, 4, 2)
    if gate_up:
        return w.reshape(e, k, 2, n // (2 * vw), vw).permute(0, 3, 1, 2, 4)
    return w.reshape(e, k, n // (2 * vw), 2 * vw).permute(0, 2, 1, 3)


def pack(w: torch.Tensor, gate_up: bool) -> torch.Tensor:
    """``w`` [E, K, N] -> its panels [E, N / NT, K, NT]; a gate-up weight's panels each hold VW gate columns then the
    VW up columns of the same range (bf16: in K-pairs, ``_panel_view``)."""
    return _panel_view(w, gate_up).contiguous().view(panels_shape(*w.shape))


def panels_shape(groups: int, k: int, n: int) -> tuple[int, int, int, int]:
    """The packed panels' shape of ``groups`` weights [K, N]: [groups, N / NT, K, NT]."""
    nt = 2 * vector_width()
    return groups, n // nt, k, nt


def packed_weight(owner: torch.nn.Module, name: str, weight: torch.Tensor, gate_up: bool) -> torch.Tensor:
    """``pack(weight.transpose(1, 2), gate_up)`` of an experts' ``weight`` [E, N, K] (as they store it), kept on
    ``owner`` under ``name`` while the weight is unchanged (``kept_copy``: nothing made on a hit)."""
    e, n, k = weight.shape
    view = lambda t: _panel_view(t.transpose(1, 2), gate_up)  # noqa: E731
    return kept_copy(owner, name, weight, view, shape=panels_shape(e, k, n))


def kept_copy(
    owner: torch.nn.Module,
    name: str,
    source: torch.Tensor | tuple[torch.Tensor, ...],
    view: Callable | None = None,
    dtype: torch.dtype | None = None,
    shape: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """A contiguous copy of ``view(source)`` (``source`` itself without a view; in ``dtype``, viewed as ``shape``),
    kept on ``owner`` under ``name`` while ``source`` (a tensor, or a tuple of them ``view`` takes as one) is unchanged:
    an engine's weights change at a sync or an adapter load only, by in-place writes that bump their versions (the view
    is made only then). Made again into the same tensor: a compiled graph reading it (``graph_panels``) keeps its
    address and sees the new values."""
    kept = owner.__dict__.setdefault("_packed", {})
    sources = source if isinstance(source, tuple) else (source,)
    stamp = (*((t.data_ptr(), t._version, t.shape, t.stride()) for t in sources), dtype)
    hit = kept.get(name)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    v = view(source) if view is not None else source
    dtype = dtype or v.dtype
    shape = torch.Size(shape or v.shape)
    if hit is not None and hit[1].shape == shape and hit[1].dtype == dtype:  # the same shape: the same tensor
        with torch.inference_mode(hit[1].is_inference()):  # made in an engine's step, maybe refreshed outside one
            hit[1].view(v.shape).copy_(v)  # one pass over the weight, no new tensor
        copy = hit[1]
    else:
        copy = torch.empty(v.shape, dtype=dtype, device=v.device)
        copy.copy_(v)
        copy = copy.view(shape)
        # a compiled graph takes it as it takes a parameter: its shape fixed, its address kept
        torch._dynamo.mark_static(copy)
        torch._dynamo.mark_static_address(copy)
        owner.__dict__.setdefault("_packed_graph", {})[name] = copy  # never replaced: the graph's guards hold
    kept[name] = (stamp, copy)
    return copy


def kept_call(owner: torch.nn.Module, name: str, key: torch.Tensor, sources: tuple, make: Callable[[], tuple]) -> tuple:
    """``make()``'s result kept on ``owner`` under ``name`` while ``key`` is the same tensor and no tensor of
    ``sources`` changed (an engine's decode step reuses its kernel arguments: their checks, copies and structs cost
    microseconds a call, the call itself a few more)."""
    stamp = tuple((t.data_ptr(), t._version) for t in sources)
    hit = owner.__dict__.get(name)
    if hit is None or hit[0] is not key or hit[1] != stamp:
        hit = owner.__dict__[name] = (key, stamp, make())
    return hit[2]


def graph_panels(owner: torch.nn.Module, name: str) -> torch.Tensor | None:
    """The panels ``packed_weight`` keeps for ``name``, as a compiled graph reads them (made and brought up to date
    outside the graph, before each step: ``moerl.engine.compiled``), or None where none are made yet."""
    return owner.__dict__.get("_packed_graph", {}).get(name)


def packed_group_mm(
    x: torch.Tensor,
    packed: torch.Tensor,
    offs: torch.Tensor,
    mode: int = 0,
    scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Rows ``x`` [M, K] sorted by group (``offs`` [G] int32: each group's end row) times their group's packed weight
    -> [M, N] (mode 0: ``packed`` from a plain weight; mode 1: from a gate-up weight, gate columns first), or for
    mode 2 the gate-up weight's ``SiLU(gate) * up * scale`` [M, N / 2] (``scale`` [M]: each row's routing weight).
    Weights fp32 or bf16; the sums in fp32 (bf16 rows widened first); the result in ``out_dtype`` (x's dtype by
    default; bf16 rounded to nearest even)."""
    g, tiles, k, nt = packed.shape
    n = tiles * nt
    if x.shape[1] != k or offs.numel() != g:
        raise ValueError(f"packed_group_mm: rows {tuple(x.shape)}, {offs.numel()} groups, weight [{g}, {k}, {n}]")
    out_dtype = out_dtype or x.dtype
    if packed.dtype not in KINDS or out_dtype not in KINDS:
        raise ValueError(f"packed_group_mm: weight {packed.dtype}, result {out_dtype}: fp32 or bf16 only")
    x, offs = x.to(torch.float32).contiguous(), offs.to(torch.int32).contiguous()
    y = x.new_empty(x.shape[0], n // 2 if mode == 2 else n, dtype=out_dtype)
    sc = scale.reshape(-1).to(torch.float32).contiguous() if scale is not None else None
    if mode == 2 and (sc is None or sc.numel() != x.shape[0]):
        raise ValueError("packed_group_mm: mode 2 needs a scale per row")
    ptr = ctypes.c_void_p
    kernel().moerl_packed_group_mm(
        ptr(x.data_ptr()),
        ptr(packed.data_ptr()),
        ptr(offs.data_ptr()),
        ptr(sc.data_ptr() if sc is not None else 0),
        g,
        k,
        n,
        mode,
        ptr(y.data_ptr()),
        KINDS[packed.dtype],
        KINDS[out_dtype],
        torch.get_num_threads(),
    )
    return y


BF16_LINEAR_MAX_ROWS = 1024  # decode's and short prefills' rows; longer prefills keep torch's GEMM


def bf16_linear_packs(weight: torch.Tensor) -> bool:
    """Whether a linear layer's ``weight`` [N, K] runs on ``bf16_linear``: bf16 on a CPU with bf16 dot products
    (``bf16_dot``), N a multiple of a panel, K of 32 (AMX's tile depth)."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2 or not bf16_dot():
        return False
    return weight.shape[0] % (2 * vector_width()) == 0 and weight.shape[1] % 32 == 0


def linear_panels(owner: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """A linear layer's ``weight`` [N, K] as one expert's packed panels [1, N / NT, K, NT], kept beside it."""
    n, k = weight.shape
    view = lambda w: _panel_view(w.t().unsqueeze(0), False)  # noqa: E731
    return kept_copy(owner, "weight", weight, view, shape=panels_shape(1, k, n))


def fused_linear(
    owner: torch.nn.Module, layers: tuple[torch.nn.Linear, ...]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Linear layers of one input side by side, as one layer ``bf16_linear`` runs: their weights' panels [1, sum(N) /
    NT, K, NT] (each N a multiple of a panel) and their biases [sum(N)] (None where none has one; zeros for a layer
    without one beside one with), kept on ``owner`` while no weight or bias changes."""
    k = layers[0].in_features
    weights = tuple(m.weight for m in layers)
    view = lambda ws: torch.cat([_panel_view(w.t().unsqueeze(0), False) for w in ws], dim=1)  # noqa: E731
    panels = kept_copy(owner, "fused weight", weights, view, shape=panels_shape(1, k, sum(w.shape[0] for w in weights)))
    biases = tuple(m.bias for m in layers if m.bias is not None)
    if not biases:
        return panels, None

    def cat(present: tuple[torch.Tensor, ...]) -> torch.Tensor:
        given = iter(present)
        return torch.cat([next(given) if m.bias is not None else m.weight.new_zeros(m.out_features) for m in layers])

    return panels, kept_copy(owner, "fused bias", biases, cat)


def bf16_lora(lora: list[torch.Tensor], panels: torch.Tensor, tile_r0: torch.Tensor | None = None) -> _Lora:
    """``bf16_linear``'s ``lora`` list checked against the weight's ``panels``, as the kernel's struct (it points into
    the list's tensors: keep them while it is used). ``tile_r0`` (int32, a panel's first shrink; layers run as one,
    ``fused_projections``): each panel's delta takes B's rank rows (fewer than A's) from its own shrinks on."""
    _, tiles, k, nt = panels.shape
    slot, scale, a, b = lora
    s, r = a.shape[:2]
    rb = b.shape[2] if b.dim() == 4 else -1
    good = (
        slot.dtype == torch.int64
        and slot.dim() == 1
        and slot.is_contiguous()
        and all(t.dtype == torch.float32 and t.is_contiguous() for t in (scale, a, b))
        and tuple(scale.shape) == (s,)
        and tuple(a.shape) == (s, r, k)
        and tuple(b.shape) == (s, tiles, rb if tile_r0 is not None else r, nt)
    )
    if tile_r0 is not None:
        good = good and tile_r0.dtype == torch.int32 and tile_r0.shape == (tiles,) and tile_r0.is_contiguous()
        good = good and bool(((tile_r0 >= 0) & (tile_r0 + rb <= r)).all())
    if not good:
        raise ValueError(_bf16_lora_error(lora, slot.shape[0], k, tiles * nt))
    ptrs = (a.data_ptr(), b.data_ptr(), 0, 0, scale.data_ptr(), slot.data_ptr())
    if tile_r0 is None:
        return _Lora(*ptrs, s, 1, r, 1)
    return _Lora(*ptrs, s, 1, r, 1, tile_r0.data_ptr(), rb)


def _bf16_lora_error(lora: list[torch.Tensor], m: int, k: int, n: int) -> str:
    shapes = ", ".join(f"{t.dtype} {tuple(t.shape)}" for t in lora)
    return f"bf16_linear: LoRA slots, scale, A, B^T panels for {m} rows of [{k}] -> [{n}]: {shapes}"


def bf16_linear(
    x: torch.Tensor,
    panels: torch.Tensor,
    bias: torch.Tensor | None,
    lora: list[torch.Tensor] | None = None,
    prepared: _Lora | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` of bf16 rows ``x`` [..., K] on the bf16 dot products (AMX's tiles or
    AVX512-BF16) from the weight's ``linear_panels``: one kernel call, the sums in fp32 (with the bias) rounded once
    to bf16. ``lora``: adapter slots whose delta joins the sums, [each row's slot [rows] int64 (-1: none), then fp32:
    scales [S], A [S, r, K], B^T's panels [S, N / NT, r, NT] (``pack`` of B^T)]; ``prepared``: its ``bf16_lora``
    struct, made before (checked there)."""
    _, tiles, k, nt = panels.shape
    n = tiles * nt
    if x.dtype != torch.bfloat16 or x.shape[-1] != k or panels.dtype != torch.bfloat16:
        raise ValueError(f"bf16_linear: rows {x.dtype} {tuple(x.shape)}, panels {panels.dtype} {tuple(panels.shape)}")
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    adapters, xa = None, None
    if lora is not None:
        if tuple(lora[0].shape) != (m,):
            raise ValueError(_bf16_lora_error(lora, m, k, n))
        adapters = prepared if prepared is not None else bf16_lora(lora, panels)
        xa = torch.empty(m, adapters.r)
    if m % 16 == 0 and rows.is_contiguous():  # whole blocks of 16 rows: read in place (a decode step's 64)
        padded = rows
    else:  # the kernel reads 16 rows a block: spare rows past the last
        padded = torch.empty(m + 16, k, dtype=torch.bfloat16)
        padded[:m].copy_(rows)
    y = torch.empty(m, n, dtype=torch.bfloat16 if bias is None else torch.float32)
    rc = kernel().moerl_bf16_linear(*bf16_linear_args(padded, m, panels, y, adapters, xa))
    if rc == -2:
        raise ValueError(f"bf16_linear: a LoRA slot outside -1..{adapters.S - 1} (max {int(lora[0].max())})")
    if bias is not None:
        y = (y + bias).to(torch.bfloat16)
    return y.view(*x.shape[:-1], n)


def bf16_linear_args(
    rows: torch.Tensor, m: int, panels: torch.Tensor, y: torch.Tensor, adapters=None, xa=None
) -> tuple:
    """``moerl_bf16_linear``'s arguments: ``m`` bf16 rows (read 16 a block: ``rows`` holds whole blocks) times the
    ``panels`` into ``y`` [m, N] (bf16, or fp32 sums a bias is added to after), ``adapters`` an ``bf16_lora`` struct
    with its shrink buffer ``xa`` [m, r]: what the eager call and a bound decode step (``moerl.cpu.direct``) pass."""
    _, tiles, k, nt = panels.shape
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    return (
        ptr(rows.data_ptr()),
        ptr(panels.data_ptr()),
        *(i32(v) for v in (m, k, tiles * nt)),
        ptr(y.data_ptr()),
        i32(y.dtype == torch.bfloat16),
        ctypes.byref(adapters) if adapters else None,
        ptr(xa.data_ptr() if xa is not None else 0),
        i32(torch.get_num_threads()),
    )


@torch.library.custom_op("moerl::bf16_linear", mutates_args=())
def bf16_linear_op(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``bf16_linear`` as one op a compiled graph calls."""
    return bf16_linear(x, panels, bias)


@bf16_linear_op.register_fake
def _(x, panels, bias):
    return x.new_empty(*x.shape[:-1], panels.shape[1] * panels.shape[3])


def norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Queries ``q`` [..., Hq, D] and keys ``k`` [..., Hk, D] (fp32 or bf16, CPU; rows of contiguous heads,
    ``rows_of``) in place: each head
    RMSNorm-ed by ``q_weight`` / ``k_weight`` [D] (None: no norm) as ``rms_norm`` computes it, then rotated
    (rotate-half RoPE) by ``cos`` / ``sin`` [..., D] as ``moerl.model.rope.apply_rope``'s ops compute it, each op's
    rounding kept: what the torch path gives, in one call."""
    d, hq, hk = q.shape[-1], q.shape[-2], k.shape[-2]
    rows = q.numel() // (hq * d)
    good = (
        q.dtype == k.dtype == cos.dtype == sin.dtype
        and q.dtype in KINDS
        and rows_of(q) is not None
        and rows_of(k) is not None
        and k.shape[-1] == d
        and k.numel() == rows * hk * d
        and cos.numel() == sin.numel() == rows * d
        and (q_weight is None) == (k_weight is None)
        and (q_weight is None or _norm_weights(q_weight, k_weight, d))
    )
    if not good:
        raise ValueError(
            f"norm_rope: q {q.dtype} {tuple(q.shape)}, k {k.dtype} {tuple(k.shape)}, cos {cos.dtype} "
            f"{tuple(cos.shape)}, weights {None if q_weight is None else tuple(q_weight.shape)}"
        )
    cos, sin = cos.contiguous(), sin.contiguous()  # kept while the kernel reads them
    kernel().moerl_norm_rope(*norm_rope_args(q, k, q_weight, k_weight, eps, cos, sin))


def norm_rope_args(q, k, q_weight, k_weight, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    """``moerl_norm_rope``'s arguments for ``norm_rope``'s checked q / k and contiguous cos / sin."""
    d, hq, hk = q.shape[-1], q.shape[-2], k.shape[-2]
    ptr = ctypes.c_void_p
    return (
        ptr(q.data_ptr()),
        ptr(k.data_ptr()),
        ctypes.c_int64(q.numel() // (hq * d)),
        *(ctypes.c_int64(rows_of(t).stride(0)) for t in (q, k)),
        *(ctypes.c_int(v) for v in (hq, hk, d)),
        ptr(q_weight.data_ptr() if q_weight is not None else 0),
        ptr(k_weight.data_ptr() if k_weight is not None else 0),
        ctypes.c_float(eps),
        ptr(cos.data_ptr()),
        ptr(sin.data_ptr()),
        ctypes.c_int(KINDS[q.dtype]),
        ctypes.c_int(KINDS[q_weight.dtype] if q_weight is not None else 0),
        ctypes.c_int(torch.get_num_threads()),
    )


def rows_of(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` [..., H, D] as rows [N, H * D] of contiguous heads, each row any stride apart (the q / k / v columns of one
    projection's output), or None where it is not one."""
    if x.dim() < 2 or x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        return None
    try:
        return x.view(-1, x.shape[-2] * x.shape[-1])
    except RuntimeError:  # leading dims that no one stride steps through
        return None


def _norm_weights(q_weight: torch.Tensor, k_weight: torch.Tensor, d: int) -> bool:
    same = q_weight.shape == k_weight.shape == (d,) and q_weight.dtype == k_weight.dtype in KINDS
    return same and q_weight.is_contiguous() and k_weight.is_contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over x's last dim (fp32 or bf16, CPU) in one call of the kernel: what ``F.rms_norm`` computes there
    (fp32 statistics, one rounding to x's dtype after the weight), without its eight ops a call."""
    d = x.shape[-1]
    if x.dtype not in KINDS or weight.dtype not in KINDS or weight.shape != (d,):
        raise ValueError(f"rms_norm: rows {x.dtype} {tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}")
    rows, weight = x.reshape(-1, d).contiguous(), weight.contiguous()
    y = torch.empty_like(rows)
    kernel().moerl_rms_norm(*rms_norm_args(rows, weight, y, eps))
    return y.view(x.shape)


def rms_norm_args(rows: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, eps: float) -> tuple:
    """``moerl_rms_norm``'s arguments: contiguous ``rows`` [N, d] normed by ``weight`` into ``y``."""
    ptr = ctypes.c_void_p
    return (
        *(ptr(t.data_ptr()) for t in (rows, weight, y)),
        ctypes.c_int64(rows.shape[0]),
        ctypes.c_int(rows.shape[1]),
        ctypes.c_float(eps),
        *(ctypes.c_int(v) for v in (KINDS[rows.dtype], KINDS[weight.dtype], torch.get_num_threads())),
    )


def add_rms_norm(
    x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + a`` and ``rms_norm(s, weight, eps)`` (fp32 or bf16 rows of one shape, CPU) in one kernel call: a
    decoder layer's residual add and the norm after it, each as its own op computes it (the sum rounded once to the
    dtype). Returns (s, the norm)."""
    d = x.shape[-1]
    good = x.dtype == a.dtype in KINDS and x.shape == a.shape and weight.dtype in KINDS and weight.shape == (d,)
    if not good:
        raise ValueError(
            f"add_rms_norm: rows {x.dtype} {tuple(x.shape)} + {a.dtype} {tuple(a.shape)}, weight {weight.dtype} "
            f"{tuple(weight.shape)}"
        )
    x, a, weight = x.contiguous(), a.contiguous(), weight.contiguous()
    s, y = torch.empty_like(x), torch.empty_like(x)
    kernel().moerl_add_rms_norm(*add_rms_norm_args(x, a, weight, eps, s, y))
    return s, y


def add_rms_norm_args(x, a, weight, eps: float, s: torch.Tensor, y: torch.Tensor) -> tuple:
    """``moerl_add_rms_norm``'s arguments: contiguous rows ``x`` + ``a`` into ``s``, its norm into ``y``."""
    d, ptr = x.shape[-1], ctypes.c_void_p
    return (
        *(ptr(t.data_ptr()) for t in (x, a, s, weight, y)),
        ctypes.c_int64(x.numel() // d),
        ctypes.c_int(d),
        ctypes.c_float(eps),
        *(ctypes.c_int(v) for v in (KINDS[x.dtype], KINDS[weight.dtype], torch.get_num_threads())),
    )


def router_topk(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    norm: bool,
    scale: float,
    replay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A softmax top-k router in one kernel call: rows ``x`` [N, H] (fp32 or bf16, CPU) against the fp32 router
    ``weight`` [E, H] (and ``bias`` [E]) in fp32 -> (gate weights [N, k] fp32: the chosen experts' probabilities,
    divided by their sum where ``norm``, times ``scale``; expert indices [N, k] int64, the most probable first).
    ``replay`` [N, k] (its range checked by the caller, ``MoEModel.check_replay``): a row not starting with -1 takes
    those experts. Where torch's GEMM and softmax sum in their own orders, the logits and weights may differ from
    theirs in the last bits."""
    e, h = weight.shape
    good = x.dtype in KINDS and x.dim() == 2 and x.shape[1] == h and weight.dtype == torch.float32 and 0 < k <= e
    good = good and (bias is None or (bias.dtype == torch.float32 and bias.shape == (e,)))
    if not good or (replay is not None and replay.shape != (x.shape[0], k)):
        shapes = f"rows {x.dtype} {tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}, k {k}"
        raise ValueError(f"router_topk: {shapes}, replay {None if replay is None else tuple(replay.shape)}")
    n, x, weight = x.shape[0], x.contiguous(), weight.contiguous()  # kept while the kernel reads them
    replay = replay.to(torch.int64).contiguous() if replay is not None else None
    gate, idx, work = torch.empty(n, k), torch.empty(n, k, dtype=torch.int64), torch.empty(router_work(e))
    kernel().moerl_router_topk(*router_args(x, weight, bias, norm, scale, gate, idx, work, replay))
    return gate, idx


def router_work(e: int) -> int:
    """The router kernel's fp32 scratch: a row's ``e`` probabilities per thread."""
    return torch.get_num_threads() * e


def router_args(x, weight, bias, norm: bool, scale: float, gate, idx, work, replay=None) -> tuple:
    """``moerl_router_topk``'s arguments: contiguous rows ``x`` against ``weight`` into ``gate`` / ``idx`` [N, k]
    (``replay``: int64 [N, k] or None)."""
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    (n, h), e, k = x.shape, weight.shape[0], idx.shape[1]
    return (
        ptr(x.data_ptr()),
        i32(KINDS[x.dtype]),
        ptr(weight.data_ptr()),
        ptr(bias.data_ptr() if bias is not None else 0),
        *(i32(v) for v in (n, h, e, k, norm)),
        ctypes.c_float(scale),
        ptr(replay.data_ptr() if replay is not None else 0),
        *(ptr(t.data_ptr()) for t in (gate, idx, work)),
        i32(torch.get_num_threads()),
    )


class _Lora(ctypes.Structure):
    """The kernels' ``lora_t``: an expert adapter's fp32 factors and each token's slot."""

    _fields_ = [(n, ctypes.c_void_p) for n in ("gu_a", "gu_b", "dn_a", "dn_bt", "scale", "slot")] + [
        (n, ctypes.c_int) for n in ("S", "E", "r", "shared")
    ]
    _fields_ += [("tile_r0", ctypes.c_void_p), ("rb", ctypes.c_int)]


def moe_lora(lora: list[torch.Tensor], gate_up: torch.Tensor, n: int) -> _Lora:
    """``moe_decode``'s ``lora`` list checked against the experts' ``gate_up`` panels and ``n`` rows, as the kernel's
    struct (it points into the list's tensors: keep them while it is used; the slots contiguous)."""
    e, _, hid, nt = gate_up.shape
    inter = gate_up.shape[1] * nt // 2
    slot, scale, gu_a, gu_b, dn_a, dn_bt = lora
    s, r = scale.shape[0], gu_b.shape[2]
    shared = gu_a.dim() == 3
    lead = (s,) if shared else (s, e)
    good = (
        all(t.dtype == torch.float32 and t.is_contiguous() for t in lora[1:])
        and slot.dtype == torch.int64
        and tuple(slot.shape) == (n,)
        and slot.is_contiguous()
        and tuple(scale.shape) == (s,)
        and tuple(gu_a.shape) == (*lead, r, hid)
        and tuple(gu_b.shape) == (s * e, 2 * inter // nt, r, nt)
        and tuple(dn_a.shape) == (s, e, r, inter)
        and tuple(dn_bt.shape) == (*lead, r, hid)
    )
    if not good:
        shapes = ", ".join(f"{k} {t.dtype} {tuple(t.shape)}" for k, t in zip(LORA_PARTS, lora, strict=True))
        raise ValueError(f"moe_decode: LoRA factors for {e} experts of [{hid}, {inter}] and {n} rows: {shapes}")
    ptrs = [t.data_ptr() for t in (gu_a, gu_b, dn_a, dn_bt, scale, slot)]
    return _Lora(*ptrs, s, e, r, int(shared))


LORA_PARTS = ("slot", "scale", "gate_up_A", "gate_up_B", "down_A", "down_B^T")  # moe_decode's lora, in order


def moe_decode(
    x: torch.Tensor,
    idx: torch.Tensor,
    gate: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    lora: list[torch.Tensor] | None = None,
    prepared: _Lora | None = None,
) -> torch.Tensor:
    """A decode step's routed experts in one kernel call (one op, eager and in a compiled graph): rows ``x`` [N, H]
    (fp32 or bf16), their experts ``idx`` [N, k] and routing weights ``gate`` [N, k] (rounded to x's dtype, as
    ``Route`` rounds them) through the packed SiLU-gated ``gate_up`` [E, 2I / NT, H, NT] and ``down`` [E, H / NT, I,
    NT] panels (``pack``) -> sum_k gate * down(SiLU(gate) * up) [N, H] in x's dtype. The sort by expert, the gather,
    both GEMMs and the per-token sum in fp32, rounded once.

    ``lora`` (None: none): adapter slots on both projections (``LORA_PARTS``: each row's slot [N] int64, -1 for
    none; then fp32: the slots' scales [S], gate-up A [S, r, H] (shared_outer) or [S, E, r, H], gate-up B as panels
    [S E, 2I / NT, r, NT] (``pack`` of B^T), down A [S, E, r, I], down B^T [S, r, H] or [S, E, r, H]): each expert's
    gate-up rows get scale * (x A^T) B^T before the activation, its down rows scale * (h A^T) B^T (shared_outer: summed
    in rank space, then expanded once per token). ``prepared``: the list's ``moe_lora`` struct, made before (checked
    there; the eager call)."""
    # eager: the function itself (a custom op's dispatch costs ~20 us a call); a compiled graph: the op
    if torch.compiler.is_compiling():
        return moe_decode_op(x, idx, gate, gate_up, down, list(lora or ()))
    return _moe_decode(x, idx, gate, gate_up, down, list(lora or ()), prepared)


@torch.library.custom_op("moerl::moe_decode", mutates_args=())
def moe_decode_op(
    x: torch.Tensor,
    idx: torch.Tensor,
    gate: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    lora: list[torch.Tensor],
) -> torch.Tensor:
    """``moe_decode`` as one op (``lora`` empty: none)."""
    return _moe_decode(x, idx, gate, gate_up, down, lora)


def _moe_decode(x, idx, gate, gate_up, down, lora: list[torch.Tensor], prepared: _Lora | None = None) -> torch.Tensor:
    n, hid = x.shape
    e, _, hk, nt = gate_up.shape
    inter = down.shape[2]
    good = (
        x.dtype in KINDS
        and gate_up.dtype == down.dtype in KINDS
        and hk == hid
        and tuple(down.shape[:2]) == (e, hid // nt)
        and gate_up.shape[1] * nt == 2 * inter
        and idx.shape == gate.shape
        and idx.shape[0] == n
    )
    if not good:
        raise ValueError(
            f"moe_decode: rows {x.dtype} {tuple(x.shape)}, idx {tuple(idx.shape)}, gate {tuple(gate.shape)}, "
            f"gate_up {gate_up.dtype} {tuple(gate_up.shape)}, down {down.dtype} {tuple(down.shape)}"
        )
    k = idx.shape[1]
    adapters = None
    if lora:
        lora[0] = lora[0].contiguous()  # the struct points at the slots
        adapters = prepared if prepared is not None and lora[0].shape == (n,) else moe_lora(lora, gate_up, n)
    x, out = x.contiguous(), torch.empty_like(x)
    idx, gate = idx.to(torch.int64).contiguous(), gate.to(torch.float32).contiguous()
    work, ints = moe_buffers(n, k, gate_up, down, adapters)
    rc = kernel().moerl_moe_decode(*moe_decode_args(x, idx, gate, gate_up, down, out, work, ints, adapters))
    if rc == -1:
        raise ValueError(f"moe_decode: an expert id outside 0..{e - 1} in idx (max {int(idx.max())})")
    if rc == -2:
        raise ValueError(f"moe_decode: a LoRA slot outside -1..{adapters.S - 1} (max {int(lora[0].max())})")
    return out


def moe_buffers(n: int, k: int, gate_up: torch.Tensor, down: torch.Tensor, adapters=None) -> tuple:
    """``moerl_moe_decode``'s scratch for ``n`` rows of ``k`` experts: (fp32 work, int32 sort buffers)."""
    e, inter, hid = gate_up.shape[0], down.shape[2], gate_up.shape[2]
    rank, shared = (adapters.r, adapters.shared) if adapters else (0, 0)
    work = torch.empty(kernel().moerl_moe_work(n, k, hid, inter, rank, shared), dtype=torch.float32)
    return work, torch.empty(2 * e + 3 * n * k, dtype=torch.int32)


def moe_decode_args(x, idx, gate, gate_up, down, out, work, ints, adapters=None) -> tuple:
    """``moerl_moe_decode``'s arguments: contiguous rows ``x`` [N, H], int64 ``idx`` and fp32 ``gate`` [N, k] through
    the panels into ``out``, with ``moe_buffers``' scratch and ``adapters`` (a ``moe_lora`` struct or None)."""
    n, k = idx.shape
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    return (
        *(ptr(t.data_ptr()) for t in (x, idx, gate)),
        *(i32(v) for v in (n, k, gate_up.shape[0], x.shape[1], down.shape[2])),
        ptr(gate_up.data_ptr()),
        ptr(down.data_ptr()),
        i32(KINDS[down.dtype]),
        ptr(out.data_ptr()),
        i32(KINDS[x.dtype]),
        ptr(work.data_ptr()),
        ptr(ints.data_ptr()),
        ctypes.byref(adapters) if adapters else None,
        i32(bf16_dot()),
        i32(torch.get_num_threads()),
    )


@moe_decode_op.register_fake
def _(x, idx, gate, gate_up, down, lora):
    return torch.empty_like(x)


def lora_add(
    x: torch.Tensor, y: torch.Tensor, slots: int | torch.Tensor, a: torch.Tensor, bt: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """``y`` [..., out] (a linear layer's output for ``x`` [..., in]; fp32 or bf16, CPU) plus its LoRA delta in one
    kernel call: scale[s] * (x A[s]^T) B[s]^T for each row's slot s (``slots``: one for every row, or [rows] int64,
    -1 for none), ``a`` [S, r, in], ``bt`` (B^T) [S, r, out] and ``scale`` [S] fp32. The sums in fp32, the result
    rounded once to y's dtype."""
    s, r, din = a.shape
    dout = y.shape[-1]
    rows = x.reshape(-1, din).contiguous() if x.shape[-1] == din else None
    good = (
        rows is not None
        and x.dtype in KINDS
        and y.dtype in KINDS
        and y.numel() == rows.shape[0] * dout
        and tuple(bt.shape) == (s, r, dout)
        and tuple(scale.shape) == (s,)
        and all(t.dtype == torch.float32 and t.is_contiguous() for t in (a, bt, scale))
        and (isinstance(slots, int) or tuple(slots.shape) == (rows.shape[0],))
    )
    if not good:
        shape = tuple(slots.shape) if isinstance(slots, torch.Tensor) else slots
        raise ValueError(
            f"lora_add: rows {x.dtype} {tuple(x.shape)}, output {y.dtype} {tuple(y.shape)}, slots {shape}, "
            f"A {a.dtype} {tuple(a.shape)}, B^T {bt.dtype} {tuple(bt.shape)}, scale {tuple(scale.shape)}"
        )
    y2, out = y.contiguous(), torch.empty_like(y)
    per_row = slots.to(torch.int64).contiguous() if isinstance(slots, torch.Tensor) else None
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    rc = kernel().moerl_lora_add(
        ptr(rows.data_ptr()),
        ptr(y2.data_ptr()),
        ptr(per_row.data_ptr() if per_row is not None else 0),
        ctypes.c_int64(slots if per_row is None else 0),
        *(ptr(t.data_ptr()) for t in (a, bt, scale)),
        ctypes.c_int64(rows.shape[0]),
        *(i32(v) for v in (s, r, din, dout)),
        ptr(out.data_ptr()),
        i32(KINDS[x.dtype]),
        i32(KINDS[y.dtype]),
        i32(torch.get_num_threads()),
    )
    if rc:
        bad = int(per_row.max()) if per_row is not None else slots
        raise ValueError(f"lora_add: a LoRA slot outside -1..{s - 1} (max {bad})")
    return out


@torch.library.custom_op("moerl::packed_group_mm", mutates_args=())
def packed_group_mm_op(
    x: torch.Tensor,
    panels: torch.Tensor,
    keys: torch.Tensor,
    n_groups: int,
    mode: int,
    scale: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``packed_group_mm`` as one op a compiled graph calls, over rows grouped by the sorted ``keys`` [M]."""
    return packed_group_mm(x, panels, Groups(keys, n_groups).offs, mode, scale, out_dtype)


@packed_group_mm_op.register_fake
def _(x, panels, keys, n_groups, mode, scale, out_dtype):
    n = panels.shape[1] * panels.shape[3]
    return x.new_empty(x.shape[0], n // 2 if mode == 2 else n, dtype=out_dtype)


@torch.library.custom_op("moerl::paged_decode", mutates_args=())
def paged_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    pos: torch.Tensor,
    sinks: torch.Tensor | None,
    block_size: int,
    window: int,
    scale: float,
) -> torch.Tensor:
    """Decode attention of queries ``q`` [B, Hq, D] over the keys and values of head-major pools [Hkv, rows, D]
    through block tables [B, nb]: keys 0..``pos`` [B] of each row (the last ``window`` of them where > 0; where < 0,
    those of the query's aligned chunk of ``-window`` positions), with
    ``sinks`` [Hq] joining each softmax -> [B, Hq, Dv] in q's dtype (CPU; pools fp32 or bf16, the sums in fp32). One
    op, eager and in a compiled graph."""
    return paged_write_decode(q, k_pool, v_pool, tables, pos, sinks, block_size, window, scale)


def paged_write_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    pos: torch.Tensor,
    sinks: torch.Tensor | None,
    block_size: int,
    window: int,
    scale: float,
    new: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``paged_decode``, eager (not an op), with ``new``: (k [B, Hkv, D], v [B, Hkv, Dv], slot [B]) this step's key
    and value of each row, written into the pools at the row's slot (-1: none) in the same call, before it is read.
    q, k and v may be the column ranges of one product (``rows_of``: read in place, not copied)."""
    b, hq, d = q.shape
    hkv, rows, dv = v_pool.shape
    nb = tables.shape[1]
    if k_pool.dtype != v_pool.dtype or k_pool.dtype not in KINDS or q.dtype != k_pool.dtype:
        raise ValueError(f"paged_decode: q {q.dtype}, pools {k_pool.dtype} / {v_pool.dtype}: all fp32 or all bf16")
    if new is not None:
        k_new, v_new, slot = new
        shapes_ok = k_new.shape == (b, hkv, d) and v_new.shape == (b, hkv, dv) and slot.shape == (b,)
        if not shapes_ok or k_new.dtype != v_pool.dtype or v_new.dtype != v_pool.dtype:
            shapes = f"k {k_new.dtype} {tuple(k_new.shape)}, v {v_new.dtype} {tuple(v_new.shape)}"
            shapes += f", slots {tuple(slot.shape)}"
            raise ValueError(f"paged_decode: new rows ({shapes}) for {b} rows of {hkv} heads, pools {v_pool.dtype}")
        new = (_rows(k_new), _rows(v_new), slot.to(torch.int64).contiguous())
    tables, pos = tables.to(torch.int64).contiguous(), pos.to(torch.int64).contiguous()
    sinks = sinks.float().contiguous() if sinks is not None else None
    out = q.new_empty(b, hq, dv)
    scratch = torch.empty(paged_scratch(hq // hkv, d, nb, block_size))
    pools, qr = (k_pool, v_pool, tables, pos, sinks), _rows(q)  # kept while the kernel reads them
    kernel().moerl_paged_decode(*paged_args(qr, hq, pools, block_size, window, scale, out, scratch, new))
    return out


def paged_scratch(g: int, d: int, nb: int, block_size: int) -> tuple[int, int]:
    """The paged kernel's fp32 scratch shape: per thread, ``g`` query heads' scores and the keys' rows over ``nb``
    blocks a row."""
    return torch.get_num_threads(), (g + 2) * nb * block_size + g * d


def paged_args(q_rows, hq: int, pools: tuple, block_size: int, window: int, scale: float, out, scratch, new) -> tuple:
    """``moerl_paged_decode``'s arguments: queries ``q_rows`` [B, Hq * D] (any row stride) of ``hq`` heads, ``pools``
    (k_pool, v_pool, int64 tables [B, nb], int64 pos [B], fp32 sinks or None), into ``out`` [B, Hq, Dv] with
    ``paged_scratch``'s ``scratch``; ``new``: (k rows, v rows, int64 slots [B]) written first, or None."""
    k_pool, v_pool, tables, pos, sinks = pools
    hkv, rows, dv = v_pool.shape
    b, d = q_rows.shape[0], k_pool.shape[2]
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    written = (ptr(0), i64(0), ptr(0), i64(0), ptr(0))
    if new is not None:
        kr, vr, slot = new
        written = (ptr(kr.data_ptr()), i64(kr.stride(0)), ptr(vr.data_ptr()), i64(vr.stride(0)), ptr(slot.data_ptr()))
    return (
        ptr(q_rows.data_ptr()),
        i64(q_rows.stride(0)),
        *(ptr(t.data_ptr()) for t in (k_pool, v_pool, tables, pos)),
        ptr(sinks.data_ptr() if sinks is not None else 0),
        *(i32(n) for n in (b, hq, hkv, d, dv)),
        i64(rows),
        i32(tables.shape[1]),
        i32(block_size),
        i64(window),
        ctypes.c_float(scale),
        ptr(out.data_ptr()),
        ptr(scratch.data_ptr()),
        *written,
        i32(KINDS[k_pool.dtype]),
        i32(torch.get_num_threads()),
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [B, H, D] as rows [B, H * D] the kernel reads in place (``rows_of``), else a contiguous copy."""
    rows = rows_of(x)
    return rows if rows is not None else x.reshape(x.shape[0], -1).contiguous()


@paged_decode.register_fake
def _(q, k_pool, v_pool, tables, pos, sinks, block_size, window, scale):
    return q.new_empty(q.shape[0], q.shape[1], v_pool.shape[2])
