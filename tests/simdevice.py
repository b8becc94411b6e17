"""A simulated CUDA device for hosts without one, to catch device mixing in CI.

Inside ``SimCuda()`` tensors made for ``cuda`` (a factory's ``device=``, ``.to("cuda")``, ``.cuda()``) are CPU
tensors the simulation tracks as being on the device; they report ``device == cuda:0`` and ``is_cuda``. Two modes do
it: a torch-function mode (what Python code sees: the device it reads, the factories and moves it calls, the host
reads it makes) and a dispatch mode under it (every ATen op, the backward's included: where results live, and the
check). An op that combines a tensor on the device with a CPU tensor of one element or more is refused as CUDA refuses
it (CPU scalars and CPU index tensors of ``t[idx]`` are allowed, as CUDA allows them; a copy between the two is a
transfer), and so is a CPU generator drawing for the device.

Host syncs are counted, by the moerl line that made them, wherever they happen (Python code or an ATen op under it,
the backward's included): reads of device values on the host (``.item()``, ``.tolist()``, ``bool``, ``.cpu()``), ops
whose CUDA kernels read their data on the host to size their output (``nonzero``, ``unique``, ``bincount``,
``masked_select``, ``repeat_interleave`` without ``output_size``, a boolean index), CUDA's grouped GEMM where it falls
back to a loop over ``offs.cpu()`` (anything but bf16 on sm90 / sm100), and copies from pageable host memory to the
device (a CUDA stream syncs before such a copy: only a pinned source copied with ``non_blocking=True`` does not; a
CPU index tensor of a device tensor is copied so too).

CUDA graphs (``torch.cuda.CUDAGraph``, ``torch.cuda.graph``): a capture records every ATen op it runs, with its
very tensors, and refuses a host sync as CUDA does while a stream captures; the outputs the ops made are then
spoiled (NaN), as a capture computes nothing; a replay runs the recorded ops again on the same tensors, writing what
they make into the recorded outputs (views stay views; in-place writes write again).

What it cannot show: the speed, kernels that exist on the CPU only, the alignment rules of CUDA kernels.
"""

from __future__ import annotations

import traceback
from collections import Counter
from contextlib import ExitStack
from types import SimpleNamespace

import torch
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from moerl.plan.fake import backward_under

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
aten = torch.ops.aten

# reads of a device value on the host that Python makes: counted here (a CPU tensor's item() under inference mode
# reaches no ATen op); the same read reaching ``_local_scalar_dense`` under them is not counted again
SYNCS = {
    "Tensor.tolist",
    "Tensor.numpy",
    "Tensor.__array__",
    "Tensor.item",
    "Tensor.__bool__",
    "Tensor.__int__",
    "Tensor.__float__",
    "Tensor.__index__",
}
# ATen ops whose CUDA kernels wait for the device: a value read back (item, bool), or an output sized by the data
SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.nonzero_static.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.bincount.default,
    aten.masked_select.default,
    aten.equal.default,
}
# a compute capability the simulated GPU reports (an H100 / H200): CUDA's grouped GEMM has its kernel there
CAPABILITY = (9, 0)
MOVES = ("Tensor.to", "Tensor.cuda", "Tensor.cpu")
# ATen ops that take CPU index tensors or a CPU source with device tensors, as CUDA does
MIXED_OK = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
    aten.copy_.default,
    aten._to_copy.default,
    aten.lift_fresh.default,
    aten.set_.source_Storage_storage_offset,
    aten.set_.source_Tensor,
}


class DeviceMixError(RuntimeError):
    """A torch call combined the simulated device's tensors with CPU tensors where CUDA refuses it."""


class CudaRuleError(RuntimeError):
    """A call CUDA refuses for another reason than devices (the grouped GEMM's stride alignment)."""


def _is_cuda(device) -> bool:
    return device is not None and not isinstance(device, torch.dtype) and torch.device(device).type == "cuda"


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class CaptureError(RuntimeError):
    """A host sync while a CUDA graph captures (CUDA: "operation not permitted when stream is capturing")."""


class _Where:
    """Which storages are on the simulated device (by address; every tensor made while simulating is recorded)."""

    def __init__(self):
        self.state: dict[int, bool] = {}
        self.reading = False  # inside a Python-level read (SYNCS), counted there
        self.capture: list | None = None  # the ops a CUDA graph capture has recorded so far (None: not capturing)

    def on(self, t: torch.Tensor) -> bool:
        storage = t.untyped_storage()  # its device is the real one (``t.device`` is what the simulation reports)
        return storage.device.type == "cpu" and t.numel() > 0 and self.state.get(storage.data_ptr(), False)

    def mark(self, out, device: bool) -> None:
        for t in _tensors(out):
            storage = t.untyped_storage()
            if storage.device.type == "cpu" and t.numel() > 0:
                self.state[storage.data_ptr()] = device


def _pageable(src: torch.Tensor, blocking: bool, pinned: set[int]) -> str | None:
    """A host -> device copy of ``src`` syncs unless its memory is pinned and the copy is non-blocking."""
    if blocking or src.untyped_storage().data_ptr() not in pinned:
        return "pageable host -> device copy"
    return None


def _count(syncs: Counter, what: str, where_: _Where | None = None) -> None:
    """One host sync, by the innermost moerl line (not this module's) of the stack that made it; refused while a
    CUDA graph captures."""
    stack = traceback.extract_stack()
    caller = next((f for f in reversed(stack) if "/moerl/" in f.filename and "simdevice" not in f.filename), None)
    where = f"{caller.filename.rsplit('/moerl/', 1)[1]}:{caller.lineno}" if caller else "outside moerl"
    if where_ is not None and where_.capture is not None:
        raise CaptureError(f"{what} at {where} while capturing a CUDA graph: operation not permitted")
    syncs[(what, where)] += 1


class _Dispatch(TorchDispatchMode):
    """Every ATen op: the check, the host syncs, and where its results live (on the device if any input is)."""

    def __init__(self, where: _Where, syncs: Counter, pinned: set[int]):
        super().__init__()
        self.where, self.syncs, self.pinned = where, syncs, pinned

    def _sync(self, func, args, kwargs, ins: list[torch.Tensor], dev: list[torch.Tensor]) -> str | None:
        """What makes this op a host sync on CUDA, if it is one."""
        if func is aten.repeat_interleave.Tensor:
            return None if kwargs.get("output_size") is not None or not ins[0].numel() else str(func)
        if func is aten.histc.default:  # CUDA reads the data's min / max when no range is given
            lo, hi = (list(args[2:4]) + [kwargs.get("min", 0), kwargs.get("max", 0)])[:2]
            return str(func) if lo == hi else None
        # copies: ``copy_`` both ways; ``_to_copy`` to the device from C++ (Python's moves are counted by _Function)
        if func is aten.copy_.default or (func is aten._to_copy.default and _is_cuda(kwargs.get("device"))):
            dst_dev = self.where.on(ins[0]) if func is aten.copy_.default else True
            src = ins[1] if func is aten.copy_.default else ins[0]
            if self.where.on(src) and not dst_dev:
                return "device -> host copy"
            if dst_dev and not self.where.on(src) and src.numel():
                blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
                return _pageable(src, blocking, self.pinned)
            return None
        if not dev:
            return None
        if func in SYNC_OPS:
            return None if func is aten._local_scalar_dense.default and self.where.reading else str(func)
        if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default):
            idx = [t for t in (args[1] if len(args) > 1 else kwargs.get("indices", ())) if isinstance(t, torch.Tensor)]
            if any(t.dtype in (torch.bool, torch.uint8) for t in idx):
                return f"{func} with a boolean index (nonzero)"
            if any(not self.where.on(t) and t.dim() > 0 and t.numel() for t in idx):
                return "pageable host -> device copy (a CPU index)"
        if func is aten._grouped_mm.default and (ins[0].dtype != torch.bfloat16 or CAPABILITY[0] not in (9, 10)):
            return f"{func} fallback ({ins[0].dtype}: offs.cpu(), one GEMM per group)"
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ins = _tensors((args, kwargs))
        # where the op runs: its tensors of one element or more decide; 0-d ones only when there are no others (a
        # device loss's scalar gradient). CUDA takes CPU scalars, and C++ makes wrapped numbers without an ATen op
        # (at an address a freed device tensor may have had): they must not pull an op onto the device
        decide = [t for t in ins if t.dim() > 0] or ins
        dev = [t for t in decide if self.where.on(t)]
        if dev and func not in MIXED_OK:
            host = [t for t in ins if not self.where.on(t) and not t.is_meta and t.dim() > 0 and t.numel()]
            if host:
                shapes = ", ".join(str(tuple(t.shape)) for t in host)
                raise DeviceMixError(
                    f"{func}: expected all tensors on one device, got cuda:0 tensors and CPU tensor(s) of shape "
                    f"{shapes}"
                )
        if dev and func is aten._grouped_mm.default and ins[0].element_size() == 2:
            # CUDA's grouped GEMM takes 16-byte-aligned strides only: each operand's leading stride (its row stride,
            # or its column stride when it is a transposed view) a multiple of 8 elements in bf16 / fp16
            for which, mat in zip(("mat_a", "mat_b"), ins[:2], strict=True):
                lead = mat.stride(-2) if mat.stride(-1) == 1 else mat.stride(-1)
                if lead % 8:
                    raise CudaRuleError(
                        f"{func}: {mat.dtype} operands need 16-byte-aligned strides (K and N multiples of 8), "
                        f"{which} {tuple(mat.shape)} has strides {mat.stride()}"
                    )
        why = self._sync(func, args, kwargs, ins, dev)
        if why is not None:
            _count(self.syncs, why, self.where)
        out = func(*args, **kwargs)
        if self.where.capture is not None:
            self.where.capture.append((_kind(func, ins, out), func, args, kwargs, out))
        if func in (aten.copy_.default, aten.set_.source_Storage_storage_offset, aten.set_.source_Tensor):
            return out  # the destination stays where it is
        if func is aten._to_copy.default and kwargs.get("device") is not None:
            # to the device: a move. To the CPU from the device: a cast C++ made with the tensor's real device (a
            # decomposition's ``.to(dtype)``: bf16 rms_norm), which stays on the device; Python's moves to the host
            # are marked by _Function after this
            self.where.mark(out, _is_cuda(kwargs["device"]) or bool(dev))
            return out
        self.where.mark(out, bool(dev))
        return out


class _Function(TorchFunctionMode):
    """What Python code sees: devices reported, factories and moves made for the device, host reads counted."""

    def __init__(self, where: _Where, syncs: Counter, pinned: set[int]):
        super().__init__()
        self.where, self.syncs, self.pinned = where, syncs, pinned

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = resolve_name(func) or getattr(func, "__name__", str(func))
        name = name.removeprefix("torch.") if name.startswith("torch.Tensor.") else name
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name in ("Tensor.device.__get__", "Tensor.is_cuda.__get__", "Tensor.is_cpu.__get__"):
            on = self.where.on(first)
            if name == "Tensor.device.__get__":
                return CUDA if on else func(*args, **kwargs)
            return on if name == "Tensor.is_cuda.__get__" else not on
        if name in ("Tensor.backward", "torch.autograd.backward"):
            return self._backward(name, args, kwargs)
        if name == "Tensor.is_pinned":
            return first.untyped_storage().data_ptr() in self.pinned
        if name == "Tensor.pin_memory" or kwargs.get("pin_memory"):  # a CPU build cannot pin: it is recorded
            out = first.clone() if name == "Tensor.pin_memory" else func(*args, **{**kwargs, "pin_memory": False})
            self.pinned.add(out.untyped_storage().data_ptr())
            self.where.mark(out, False)
            return out
        target = self._target(name, args, kwargs)
        dev_in = any(self.where.on(t) for t in _tensors((args, kwargs)))
        if name in SYNCS and dev_in:
            self._count(name)
            self.where.reading = True
            try:
                return func(*args, **kwargs)
            finally:
                self.where.reading = False
        if _is_cuda(target):
            if isinstance(kwargs.get("generator"), torch.Generator):
                raise DeviceMixError(f"{name}: a CPU generator cannot draw for the CUDA device")
            if name in MOVES and first is not None and not self.where.on(first):
                blocking = not (kwargs.get("non_blocking") or any(a is True for a in args[1:]))
                why = _pageable(first, blocking, self.pinned)
                if why is not None:
                    self._count(why)
            elif name in ("torch.tensor", "torch.as_tensor", "torch.asarray"):  # from Python data, through the host
                self._count("pageable host -> device copy")
            out = first.clone() if name in MOVES and first is not None else func(*args, **{**kwargs, "device": CPU})
            if name == "Tensor.to":  # a dtype given with the device
                dtype = next((a for a in (*args[1:], kwargs.get("dtype")) if isinstance(a, torch.dtype)), None)
                out = out.to(dtype) if dtype is not None else out
            self.where.mark(out, True)
            return out
        if (
            name in MOVES and dev_in and target is not None
        ):  # device -> host: a new host tensor, and the host waits for it
            self._count("device -> host copy")
            out = func(*args, **kwargs)
            out = out.clone() if out.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() else out
            self.where.mark(out, False)
            return out
        out = func(*args, **kwargs)
        if not _tensors((args, kwargs)):  # made from Python values (torch.tensor makes it without an ATen op)
            self.where.mark(out, False)
        return out  # else where its results live: the dispatch mode says

    def _backward(self, name: str, args, kwargs) -> None:
        """Run the autograd engine with this mode on, so the Python backward of custom autograd functions sees the
        devices as the forward did (a mode is off inside its own handler)."""
        backward_under(self, name == "Tensor.backward", args, kwargs)

    def _target(self, name: str, args, kwargs):
        """The device a factory or a move makes its result on (None: no such call)."""
        if name == "Tensor.cuda":
            return CUDA
        if name == "Tensor.cpu":
            return CPU
        if name == "Tensor.to":
            for a in (*args[1:], kwargs.get("device")):
                if isinstance(a, str | torch.device):
                    return torch.device(a)
                if isinstance(a, torch.Tensor):
                    return CUDA if self.where.on(a) else CPU
            return None
        return kwargs.get("device")

    def _count(self, what: str) -> None:
        _count(self.syncs, what, self.where)


def _kind(func, ins: list[torch.Tensor], out) -> str:
    """How a replay runs a recorded op: "write" (in place: again), "view" (its outputs view its inputs: not at all)
    or "new" (again, into the recorded outputs). An op that may view or copy (``to``, ``reshape``) is what it did."""
    returns = [r.alias_info for r in func._schema.returns]
    if any(a is not None and a.is_write for a in returns):
        return "write"
    held = {t.untyped_storage().data_ptr() for t in ins}
    outs = _tensors(out)
    return "view" if outs and all(t.untyped_storage().data_ptr() in held for t in outs) else "new"


class _Graph:
    """``torch.cuda.CUDAGraph`` on the simulated device: the recorded ops of its capture, run again by ``replay``."""

    def __init__(self, *args, **kwargs):
        self.ops: list | None = None
        self.where: _Where | None = None  # set by the capture

    def pool(self) -> tuple[int, int]:
        return (0, id(self))

    def replay(self) -> None:
        if self.ops is None:
            raise RuntimeError("CUDAGraph.replay: nothing captured")
        for kind, func, args, kwargs, out in self.ops:
            if kind == "view":  # it still views what it viewed
                continue
            made = func(*args, **kwargs)  # an in-place op writes again; a new result goes where the graph's is
            if kind == "new":
                for old, new in zip(_tensors(out), _tensors(made), strict=True):
                    self.where.mark(new, self.where.on(old))  # made where the graph's output is: no transfer
                    old.copy_(new)


class _Capture:
    """``torch.cuda.graph(g, pool=...)`` on the simulated device."""

    def __init__(self, where: _Where, graph: _Graph, pool=None, **kwargs):
        self.where, self.graph = where, graph

    def __enter__(self):
        if self.where.capture is not None:
            raise RuntimeError("torch.cuda.graph: a capture is already under way")
        self.where.capture = []
        return self

    def __exit__(self, *exc) -> None:
        ops, self.where.capture = self.where.capture, None
        self.graph.ops, self.graph.where = ops, self.where
        if exc[0] is None:  # a capture computes nothing: what the ops made holds no values until a replay
            for kind, _, _, _, out in ops:
                if kind == "new":
                    for t in _tensors(out):
                        t.fill_(float("nan") if t.is_floating_point() else -(2**30) if t.dtype != torch.bool else 0)


class SimCuda:
    """``with SimCuda() as sim:`` runs torch as if a CUDA device were there (see the module docstring): ``torch.cuda``
    answers as on a host with one GPU (compute capability ``CAPABILITY``) with ``sim.free_memory`` bytes free.
    ``sim.syncs`` counts host syncs by (what, moerl line); ``sim.pinned`` holds the pinned host memory."""

    def __init__(self, free_memory: int = 64 * 2**30):
        self.where, self.syncs, self.free_memory = _Where(), Counter(), free_memory
        self.pinned: set[int] = set()  # storages of host memory made pinned while simulating
        self._stack = ExitStack()

    def on_device(self, t: torch.Tensor) -> bool:
        return self.where.on(t)

    def __enter__(self) -> SimCuda:
        try:  # torchao probes CUDA when it loads: it loads on the real answer, before the simulated one
            import torchao.prototype.mx_formats  # noqa: F401
        except ImportError:
            pass
        answers = {
            "is_available": lambda: True,
            "device_count": lambda: 1,
            "current_device": lambda: 0,
            "set_device": lambda device: None,
            "mem_get_info": lambda device=None: (self.free_memory, 2 * self.free_memory),
            "get_device_capability": lambda device=None: CAPABILITY,
            "get_device_properties": lambda device=None: SimpleNamespace(
                name="simulated GPU", uuid="GPU-simulated-0", total_memory=2 * self.free_memory, major=CAPABILITY[0]
            ),
            "get_device_name": lambda device=None: "simulated GPU",
            "CUDAGraph": _Graph,
            "graph": lambda graph, pool=None, **kwargs: _Capture(self.where, graph, pool, **kwargs),
        }
        for name, answer in answers.items():
            self._stack.callback(setattr, torch.cuda, name, getattr(torch.cuda, name))
            setattr(torch.cuda, name, answer)
        # a tensor from numpy memory is made by no ATen op and no torch function the modes see: marked on the host
        # here, or it would take the mark of a freed device tensor that had its address
        from_numpy = torch.from_numpy
        self._stack.callback(setattr, torch, "from_numpy", from_numpy)

        def host_from_numpy(array):
            out = from_numpy(array)
            self.where.mark(out, False)
            return out

        torch.from_numpy = host_from_numpy
        self._stack.enter_context(_Dispatch(self.where, self.syncs, self.pinned))
        self._stack.enter_context(_Function(self.where, self.syncs, self.pinned))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
