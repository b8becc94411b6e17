"""moerl's own code run on tensors that have shapes and no storage: how a plan sees a run without its memory.

``Shapes()`` is torch's ``FakeTensorMode`` (every tensor made inside it has a shape, a dtype and a device, and no
data) plus what a plan needs on top: the integer tensors whose values decide shapes (token ids, masks, R3's replayed
experts, packing indices, the counts of an expert exchange) keep their values. An op whose integer inputs are all
known runs for real on the CPU beside its fake twin, so a grouped GEMM's group offsets, a packed row's layout or an
``all_to_all``'s split sizes are the run's own. Floating-point tensors never get values: a float read on the host
(a loss summed into a metric) reads 0.0 and is counted.

Three things a run's values decide are not known from its inputs, and the plan assumes them:
- a router's choice (``topk`` of scores it cannot compute): balanced, row r taking experts ``r*k .. r*k+k-1``
  (mod the experts); R3 replay replaces it wherever the batch carries the engine's routing;
- finiteness: every float is finite (``isfinite`` true, ``isnan`` / ``isinf`` false);
- what the other ranks send: the same as this rank (the fake process group's collectives return this rank's own
  data), i.e. every rank's share of the work is alike.

A host read of an integer the plan cannot know raises ``PlanError`` naming the op: the plan then has a shape it would
have to guess, and it does not guess.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.overrides import TorchFunctionMode
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import arg_tree_leaves, tree_flatten, tree_map, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from moerl.device import gpu_planned

aten = torch.ops.aten

# ops whose output's shape is their input's data: run for real when the input is known, else a PlanError
DATA_SHAPED = {
    aten.nonzero.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.bincount.default,
    aten.masked_select.default,
    aten.repeat_interleave.Tensor,
}
METADATA = {torch.ops.prim.device.default, aten.sym_size.default, aten.sym_stride.default, aten.sym_numel.default}
MASK_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
SCALAR_READS = {aten._local_scalar_dense.default, aten.item.default}
MAX_VALUE_NUMEL = 2**25  # elements of an op's outputs the trace computes for real (larger ones: fake only)
ASSUMED_MAX_NUMEL = 2**16  # elements of a finiteness test the plan gives an assumed value (``Shapes.assume``)
MADE_FROM_HOST = {"frombuffer", "from_numpy"}  # tensors over host memory: real, not fake
HOST_READS = {"tolist", "numpy", "__array__"}  # Tensor methods that read data without an ATen op of their own


class PlanError(RuntimeError):
    """The plan met a value it cannot know (a host read of data no input determines)."""


def _faking() -> bool:
    """Whether a fake mode is active (torch lifts it around work that needs real tensors)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def _integral(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex())


class _Known(TorchDispatchMode):
    """The dispatch half of ``Shapes``: integer values carried beside the fake tensors."""

    def __init__(self, shapes: Shapes):
        super().__init__()
        self.shapes = shapes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in METADATA or not _faking():  # torch itself may lift the fake mode (a device mesh's own tensors)
            return func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        flat = arg_tree_leaves(*args, **kwargs)
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        if func in SCALAR_READS:
            return self.shapes.read(func, args[0], self.shapes.value(args[0]))
        if func in MASK_INDEXED and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            args = (args[0], self._positions(args[1]), *args[2:])  # the mask's known places, as integer indices
            return self.__torch_dispatch__(func, types, args, kwargs)
        if any(isinstance(a, torch.UntypedStorage) for a in flat):  # a storage of its own (set_): no values
            known = False
        elif tensors:
            known = all(self.shapes.value(t) is not None for t in tensors)
        else:  # a factory: known when it makes integers (arange, zeros of indices), never for floats
            dtype = kwargs.get("dtype")
            if dtype is None and func.overloadpacket is aten.arange:  # arange's dtype follows its arguments
                dtype = torch.int64 if all(isinstance(a, int) for a in args) else None
            known = isinstance(dtype, torch.dtype) and not (dtype.is_floating_point or dtype.is_complex)
        if known and torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
            flat, spec = tree_flatten((args, kwargs))
            values = [self.shapes.value(a) if isinstance(a, torch.Tensor) else a for a in flat]
            return self._run_both(func, args, kwargs, values, spec)
        if func in DATA_SHAPED:
            raise PlanError(f"{func}: its output's shape is data the plan does not know")
        if func is aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            return _grouped_mm_like(*args, **kwargs)
        out = func(*args, **kwargs)
        if func in (aten.isnan.default, aten.isinf.default):
            self.shapes.assume(out, False)
        elif func is aten.topk.default:
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            self.shapes.assume_balanced(out[1], args[0].shape[dim], dim)
        elif func._schema.is_mutable:  # written by an op of unknown inputs: its value is gone
            for t in tensors:
                self.shapes.forget(t)
        return out

    def _positions(self, indices: list) -> list:
        """``indices`` with each known boolean mask as the integer indices of its true places (one per dim)."""
        out = []
        for i in indices:
            value = self.shapes.value(i) if isinstance(i, torch.Tensor) and i.dtype == torch.bool else None
            if value is None:
                out.append(i)
                continue
            with no_dispatch():
                places = value.nonzero().unbind(1)
            out += [self.shapes.lift(p, i.device) for p in places]
        return out

    def _run_both(self, func, args, kwargs, values, spec):
        """The op on the fakes and, where its output is small enough to hold, on the values too."""
        out = data_shaped = object()
        if func not in DATA_SHAPED:
            try:
                out = func(*args, **kwargs)
            except (DynamicOutputShapeException, DataDependentOutputException):  # e.g. a boolean index
                pass
        if out is data_shaped:  # the fake takes the real output's shape
            real = self._real(func, values, spec)
            device = next(t.device for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor))
            out = tree_map(
                lambda r: (
                    torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device=device)
                    if isinstance(r, torch.Tensor)
                    else r
                ),
                real,
            )
        else:
            made = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
            if not made:  # a scalar, a shape: the value itself
                return self._real(func, values, spec)
            if sum(o.numel() for o in made) > MAX_VALUE_NUMEL:  # too large to hold: no value
                for t in tree_flatten((args, kwargs))[0]:
                    if isinstance(t, torch.Tensor) and func._schema.is_mutable:
                        self.shapes.forget(t)
                return out
            real = self._real(func, values, spec)
        for o, r in zip(tree_flatten(out)[0], tree_flatten(real)[0], strict=False):
            if isinstance(o, FakeTensor) and isinstance(r, torch.Tensor):
                self.shapes.values[o] = r
        return out

    @staticmethod
    def _real(func, values, spec):
        real_args, real_kwargs = tree_unflatten(values, spec)
        if "device" in real_kwargs:  # the values live on the CPU whatever device the fake claims
            real_kwargs = {**real_kwargs, "device": torch.device("cpu")}
        with no_dispatch():
            return func(*real_args, **real_kwargs)


def _grouped_mm_like(a: torch.Tensor, b: torch.Tensor, *rest, **kwargs) -> torch.Tensor:
    """The output of ``torch._grouped_mm`` in another dtype than bf16 (the CPU's kernel takes any; the shape rule,
    torch's meta kernel, is written for CUDA's bf16 only): the rule applied to bf16 stand-ins."""
    with no_dispatch():
        meta = [torch.empty_strided(t.shape, t.stride(), dtype=torch.bfloat16, device="meta") for t in (a, b)]
        offs = rest[0] if rest else kwargs.get("offs")
        offs = None if offs is None else torch.empty(offs.shape, dtype=offs.dtype, device="meta")
        shape = torch._grouped_mm(*meta, offs=offs).shape
    return torch.empty(shape, dtype=kwargs.get("out_dtype") or a.dtype, device=a.device)


def _cuda_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``scaled_dot_product_attention`` as CUDA runs it, where a plan of a GPU run traces it on the CPU (whose kernels
    differ: a masked CPU call materialises every score): flash attention without a mask (half precision, equal head
    dims up to 256), else memory-efficient attention on the mask made a float bias. Neither keeps the [T, S] scores
    for the backward, only the output and a log-sum-exp per row. Grouped-query heads are repeated to the query's
    count first (an upper bound where the kernel would share them)."""
    hq, hkv = q.shape[1], k.shape[1]
    if enable_gqa and hq != hkv:
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    flash = attn_mask is None and q.shape[-1] == v.shape[-1] <= 256 and q.dtype in (torch.bfloat16, torch.float16)
    if flash:
        return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    bias = attn_mask
    if bias is not None and bias.dtype == torch.bool:  # as SDPA turns a boolean mask into a bias
        bias = torch.zeros(bias.shape, dtype=q.dtype, device=q.device).masked_fill(~bias, float("-inf"))
    if bias is not None:
        bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, dropout_p, is_causal, scale=scale)[0]


class _FusedRMSNorm(torch.autograd.Function):
    """CUDA's fused RMSNorm (``aten._fused_rms_norm``) as a plan traces it on fake tensors: the normed output and an
    fp32 reciprocal RMS per row, keeping the input, the weight and that RMS for the backward. On the CPU the same call
    is composite and keeps an fp32 copy of the input and its products (the first GPU run measured a full step of the
    small preset 17% under a plan that traced the CPU's)."""

    @staticmethod
    def forward(ctx, x, weight, dims: int):
        rstd = x.new_empty((*x.shape[: x.ndim - dims], *(1,) * dims), dtype=torch.float32)
        ctx.save_for_backward(x, weight, rstd)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        x, weight, _ = ctx.saved_tensors
        return torch.empty_like(x), None if weight is None else torch.empty_like(weight), None


def _cuda_rms_norm(x, normalized_shape, weight=None, eps=None):
    """``F.rms_norm`` as CUDA runs it (the dispatch of ``aten.rms_norm``): the fused kernel where the weight's dtype is
    the input's (or there is none) and the input is real-valued, else the composite, as on the CPU."""
    if x.is_complex() or (weight is not None and weight.dtype != x.dtype):
        return F.rms_norm(x, normalized_shape, weight, eps)
    return _FusedRMSNorm.apply(x, weight, len(normalized_shape))


def backward_under(mode: TorchFunctionMode, tensor_method: bool, args, kwargs) -> None:
    """``Tensor.backward`` (``tensor_method``) or ``torch.autograd.backward`` of ``args`` / ``kwargs`` with ``mode`` on
    the torch-function stack: a mode is off inside its own handler, so the Python a backward runs (custom functions'
    backwards, a checkpointed block computed again) would run without it. The engine is called as
    ``torch.autograd.backward`` calls it, after its checks."""
    from torch.autograd.graph import _engine_run_backward

    if tensor_method:
        params = dict(zip(("gradient", "retain_graph", "create_graph", "inputs"), args[1:], strict=False)) | kwargs
        tensors, grads = (args[0],), (params.get("gradient"),)
    else:
        params = dict(zip(("grad_tensors", "retain_graph", "create_graph"), args[1:], strict=False)) | kwargs
        tensors = (args[0],) if isinstance(args[0], torch.Tensor) else tuple(args[0])
        grads = params.get("grad_tensors") or (None,) * len(tensors)
        grads = (grads,) if isinstance(grads, torch.Tensor) else tuple(grads)
    grads = tuple(torch.ones_like(t) if g is None else g for t, g in zip(tensors, grads, strict=True))
    create, retain = bool(params.get("create_graph", False)), params.get("retain_graph")
    inputs = params.get("inputs") or ()
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    torch._C._push_on_torch_function_stack(mode)
    try:
        _engine_run_backward(tensors, grads, create if retain is None else retain, create, inputs,
                             allow_unreachable=True, accumulate_grad=True)  # fmt: skip
    finally:
        torch._C._pop_torch_function_stack()


class _Reads(TorchFunctionMode):
    """The Python half of ``Shapes``: host reads that reach no ATen op (``tolist``, ``numpy``) answered from the
    known values."""

    def __init__(self, shapes: Shapes):
        super().__init__()
        self.shapes = shapes

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if func in (torch.Tensor.backward, torch.autograd.backward):  # a recomputed block must take the GPU paths too
            return backward_under(self, func is torch.Tensor.backward, args, kwargs)
        if name in HOST_READS and args and isinstance(args[0], torch.Tensor):
            value = self.shapes.value(args[0])
            if value is None:
                raise PlanError(f"Tensor.{name}() of data the plan does not know")
            with no_dispatch():
                return getattr(value, name)(*args[1:], **kwargs)
        if func is F.scaled_dot_product_attention and gpu_planned():
            return _cuda_attention(*args, **kwargs)
        if func is F.rms_norm and gpu_planned():
            return _cuda_rms_norm(*args, **kwargs)
        if name in ("__getitem__", "__setitem__") and len(args) > 1:  # a 0-d index is read in C++, off the data
            args = (args[0], self._scalar_indices(args[1]), *args[2:])
        if name in MADE_FROM_HOST:  # host data: a real tensor, its own value
            with _disable_current_modes():
                return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if name == "isfinite" and isinstance(out, FakeTensor) and out not in self.shapes.values:
            self.shapes.assume(out, True)  # a composite of several ops: assumed here, where it is one call
        return out

    def _scalar_indices(self, index):
        """An index with its known 0-d integer tensors as the ints they hold."""

        def one(i):
            if isinstance(i, FakeTensor) and i.ndim == 0 and not i.is_floating_point():
                value = self.shapes.value(i)
                if value is None:
                    raise PlanError("an index of a value the plan does not know")
                with no_dispatch():
                    return int(value)
            return i

        return tuple(one(i) for i in index) if isinstance(index, tuple) else one(index)


class Shapes:
    """The context a plan runs moerl's code in (see the module docstring). ``float_reads``: host reads of floats
    answered 0.0; ``assumed``: router choices taken as balanced."""

    def __init__(self):
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.values: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.float_reads = 0
        self.assumed = 0
        self._modes = (self.fake, _Known(self), _Reads(self))

    def __enter__(self) -> Shapes:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def lift(self, real: torch.Tensor, device) -> torch.Tensor:
        """A fake tensor on ``device`` whose value is ``real`` (a CPU tensor)."""
        with _disable_current_modes():
            meta = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device="meta")
        fake = FakeTensor(self.fake, meta, device=device)
        self.values[fake] = real
        return fake

    def value(self, t: torch.Tensor) -> torch.Tensor | None:
        """The CPU value of ``t``: a fake tensor's known one (else None), a plain real tensor itself."""
        if isinstance(t, FakeTensor):
            return self.values.get(t)
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type == "meta":
            return None  # a wrapper (a DTensor: its shards hold the values) or a meta tensor: no value here
        return t

    def forget(self, t: torch.Tensor) -> None:
        if isinstance(t, FakeTensor):
            self.values.pop(t, None)

    def read(self, func, t: torch.Tensor, value: torch.Tensor | None):
        """A scalar read on the host (``item``, ``bool``, ``int``)."""
        if value is not None:
            with no_dispatch():
                return value.item()
        if t.is_floating_point():
            self.float_reads += 1
            return 0.0
        raise PlanError(f"{func} of an integer the plan does not know (a shape or a branch would depend on it)")

    def assume(self, t: torch.Tensor, value: bool) -> None:
        """``t`` (a finiteness test of floats the plan cannot compute) as ``value``: the plan's floats are finite.
        A test of more than ``ASSUMED_MAX_NUMEL`` elements keeps no value: the host reads only small ones (a check's
        flags), and computing on large ones (an MX quantizer tests every GEMM input) took most of an MXFP8 plan."""
        if t.numel() > ASSUMED_MAX_NUMEL:
            return
        with no_dispatch():
            self.values[t] = torch.full(t.shape, value, dtype=torch.bool)

    def assume_balanced(self, idx: torch.Tensor, choices: int, dim: int) -> None:
        """``idx`` (the top-k indices, along ``dim``, of ``choices`` scores the plan cannot compute) as balanced: row
        r takes r*k .. r*k+k-1 (mod ``choices``)."""
        shape = list(idx.shape)
        k = shape.pop(dim)
        with no_dispatch():
            rows = torch.arange(idx.numel() // max(k, 1))
            spread = (rows[:, None] * k + torch.arange(k)) % max(choices, 1)
            self.values[idx] = spread.reshape(*shape, k).movedim(-1, dim).contiguous()
        self.assumed += 1
