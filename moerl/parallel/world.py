"""The trainer's ranks: started by moerl through torchrun's launcher (``torch.distributed.run``), or by an outer
``torchrun``; one process group (gloo on CPU, nccl on GPU)."""

from __future__ import annotations

import datetime
import faulthandler
import gc
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

from moerl.child import proc_alive, proc_children, proc_stopped
from moerl.device import resolve_device
from moerl.errors import ConfigError, Preempted, TrainingStopped
from moerl.parallel.ends import EndWatch


@dataclass(slots=True)
class World:
    """This rank's place: ``size = pp x dp x ep x cp`` ranks, numbered stage-major, then data-parallel, then expert,
    then context (``rank = ((stage * dp + dp_index) * ep + ep_index) * cp + cp_index``). The dp x ep ranks of a stage
    take different rows of a batch (the data group); the ep ranks of a data-parallel replica split each MoE layer's
    experts; the cp ranks of a data rank take the same rows and split their tokens (``moerl.parallel.context``). FSDP
    shards over all dp x ep x cp ranks of a stage."""

    rank: int = 0
    size: int = 1
    dp: int = 1
    ep: int = 1
    pp: int = 1
    schedule: str = "1f1b"  # pipeline schedule (pp > 1)
    microbatches: int = 0  # pipeline micro-batches per call (0: one per stage, or as micro_batch_size needs)
    stages: list[int] | None = None  # layers per pipeline stage (None: balanced by parameter count)
    mesh: DeviceMesh | None = None  # dims ("pp", "dp", "ep"); None for one process
    data_mesh: DeviceMesh | None = None  # this stage's dp x ep x cp ranks as one dimension: FSDP shards over it
    cp: int = 1  # context-parallel ranks: one sequence's tokens split over them
    rows_mesh: DeviceMesh | None = None  # this stage's dp x ep ranks of this cp index: the data group
    # this rank's coordinates, from ``rank``
    stage: int = field(init=False)  # its pipeline rank (its first stage)
    data_rank: int = field(init=False)  # its index in the data group (dp x ep): which rows it takes
    dp_rank: int = field(init=False)
    ep_rank: int = field(init=False)
    cp_rank: int = field(init=False)  # which part of each sequence's tokens it takes

    def __post_init__(self) -> None:
        self.stage, within = divmod(self.rank, self.dp * self.ep * self.cp)
        self.data_rank, self.cp_rank = divmod(within, self.cp)
        self.dp_rank, self.ep_rank = divmod(self.data_rank, self.ep)

    @property
    def driver(self) -> bool:
        """Rank 0 runs the loop (rollouts, rewards, metrics, weight sync, checkpoints); every rank trains."""
        return self.rank == 0

    @property
    def data_size(self) -> int:
        """The data group's ranks (dp x ep): how many shares a batch's rows are split into."""
        return self.dp * self.ep

    @property
    def shard_size(self) -> int:
        """The ranks FSDP shards a stage over (dp x ep x cp)."""
        return self.dp * self.ep * self.cp

    def close(self) -> None:
        """Leave the process group (every rank, once its work is done): its connections close in order instead of
        being torn down at interpreter exit."""
        if self.size > 1 and dist.is_initialized():
            # the pipeline's stages and schedules of past calls (and the P2P work they hold) sit in reference cycles:
            # freed here, while their process groups still exist, not by the interpreter's exit after the groups
            # are gone. A guess at the rare "terminate called without an active exception" of a pp=2 rank (issue
            # 21), seen once more in a fresh-clone run: not reproduced since, so not confirmed.
            gc.collect()
            dist.barrier()
            dist.destroy_process_group()

    def group(self, dim: str):
        """The process group of mesh dimension ``dim`` (``pp``, ``dp``, ``ep``, ``cp``, or ``data`` = dp x ep) of
        this rank; None (the default group) for one process."""
        if self.mesh is None:
            return None
        return self.rows_mesh.get_group() if dim == "data" else self.mesh.get_group(dim)


QUIET_CTRL_C = "MOERL_QUIET_CTRL_C"


def under_launcher() -> bool:
    """Whether this process is one rank of a torchrun launch (moerl's own or an outer one)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def launch(moerl_argv: list[str], nprocs: int, run_dir: str) -> None:
    """Run ``python -m moerl.cli <moerl_argv>`` on ``nprocs`` ranks of this machine with torchrun's launcher and wait;
    if a rank fails, the launcher stops the others and this raises TrainingStopped with the failing rank's message.
    The launcher's own log lines go to ``run_dir``'s libraries.log (moerl.logs)."""
    from moerl.logs import held_lines

    with held_lines("torch.distributed", run_dir):
        _launch(moerl_argv, nprocs)


def _launch(moerl_argv: list[str], nprocs: int) -> None:
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: the ranks talk over loopback only
    os.environ[QUIET_CTRL_C] = "1"  # the ranks end quietly on Ctrl-C: this process says it once
    # a scheduler's SIGTERM / SIGUSR1 is not the launcher's to act on (it would stop the ranks): it passes it on to
    # them (Kubernetes signals the main process only) and rank 0 saves the run and ends it (moerl.preempt)
    handled = "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT"
    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nprocs}", "--monitor-interval=0.5", handled, "--module", "moerl.cli"]
        + moerl_argv
    )
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)  # its shutdown notes: ours is one line
    before = {s: signal.signal(s, _pass_on) for s in (signal.SIGTERM, signal.SIGUSR1)}
    watch = EndWatch(nprocs)
    try:
        with watch:
            run(args)
    except SignalException as e:  # Ctrl-C (or a kill) of the launcher: it has stopped the ranks
        if e.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise TrainingStopped(f"the launcher got {e.sigval.name}; it stopped the {nprocs} trainer ranks") from None
    except ChildFailedError as e:
        if watch.stopped and set(e.failures) <= set(watch.stopped):  # the others ended well: the run is complete
            print("moerl: every rank passed the run's final barrier: its results stand", file=sys.stderr, flush=True)
            return
        # the first rank that said why (its error file), else the first to fail: a rank that names a stopped peer
        # ends it, and the launcher may see that peer's death first
        said = [(r, f) for r, f in e.failures.items() if os.path.isfile(f.error_file)]
        rank, failure = min(said, key=lambda rf: rf[1].timestamp) if said else e.get_first_failure()
        message = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
        if failure.exitcode == Preempted.exit_code:  # rank 0 saved the run at a scheduler's signal
            raise Preempted(_said(message)) from None
        raise TrainingStopped(
            f"trainer rank {rank} of {nprocs} failed (exit code {failure.exitcode}): {message.strip() or 'see above'}; "
            "the launcher stopped the other ranks"
        ) from None
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _pass_on(signum: int, frame) -> None:
    """The launcher's share of a scheduler's signal: pass it on to the ranks (its child processes)."""
    for pid in proc_children(os.getpid()):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _said(message: str) -> str:
    """A rank's recorded error message without its exception class and traceback (what the rank printed)."""
    first = message.strip().splitlines()[0] if message.strip() else "see above"
    return first.split(": ", 1)[1] if first.startswith("Preempted: ") else first


def mesh_device(name: str, ranks_here: int) -> str:
    """The device type of the trainer's mesh for ``policy.device`` ``name`` with ``ranks_here`` ranks on this node:
    ``cpu`` where the policy is on the CPU (a CUDA host included: gloo only, no GPU touched), else ``cuda``, one GPU
    per rank. A layout the node's GPUs cannot hold is refused before any group forms (NCCL fails two ranks on one GPU
    at their first collective, "duplicate GPU")."""
    device = resolve_device(name, key="policy.device")
    if device.type == "cpu":
        return "cpu"
    count = torch.cuda.device_count()
    if name != "auto" and torch.device(name).index is not None and ranks_here > 1:
        raise ConfigError(
            f"policy.device={name!r} with {ranks_here} trainer ranks on this node: every rank would take that one GPU; "
            "use policy.device=auto (or cuda): each rank takes the GPU of its LOCAL_RANK"
        )
    if ranks_here > count:
        raise ConfigError(
            f"parallel.dp x parallel.ep x parallel.pp: {ranks_here} trainer ranks on this node, which has {count} CUDA "
            f"device(s); a rank takes a GPU of its own: at most {count} ranks per node (or policy.device=cpu)"
        )
    return "cuda"


def init_world(
    dp: int = 1, ep: int = 1, pp: int = 1, timeout_s: float = 1800.0, device: str = "auto", cp: int = 1, **pipeline
) -> World:
    """Join the process group of this launch (a no-op for one rank outside a launcher); checks its size and builds
    the ``(pp, dp, ep, cp)`` mesh on ``device``'s kind (``policy.device``: ``mesh_device``). ``timeout_s``: how long a
    collective waits for the other ranks before it fails (``stalled`` names the rank that stopped). ``pipeline``:
    World's schedule, microbatches and stages."""
    size = dp * ep * pp * cp
    if size == 1 and not under_launcher():
        return World()
    kind = mesh_device(device, int(os.environ.get("LOCAL_WORLD_SIZE", size)))
    # a rank that the C++ side aborts (std::terminate, SIGSEGV) prints every thread's Python stack, so the log
    # says where (an interleaved-1F1B LoRA rank once died with SIGABRT on an AMX host, no Python traceback)
    faulthandler.enable()
    _die_with_the_launcher()
    if os.environ.get(QUIET_CTRL_C):  # Ctrl-C reaches every rank and the launcher: the launcher speaks for all
        signal.signal(signal.SIGINT, lambda *_: os._exit(130))
    if kind == "cuda":  # this rank's GPU before any CUDA work or communicator: cuda:N as named, else its LOCAL_RANK's
        named = resolve_device(device, key="policy.device")
        torch.cuda.set_device(named if named.index is not None else int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        # CPU tensors (the announced batches, JSON headers, metric sums) over gloo, CUDA tensors over NCCL
        backend = "cpu:gloo,cuda:nccl" if kind == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    if dist.get_world_size() != size:
        raise ConfigError(
            f"parallel.dp x parallel.ep x parallel.pp{' x parallel.cp' if cp > 1 else ''} = {size} ranks, but the "
            "launcher started "
            f"{dist.get_world_size()}; start it with --nproc-per-node={size} (or let moerl start the ranks: run it "
            "without torchrun)"
        )
    return _on_mesh(dist.get_rank(), dp, ep, pp, cp, kind, pipeline)


def fake_world(dp: int = 1, ep: int = 1, pp: int = 1, rank: int = 0, cp: int = 1, **pipeline) -> World:
    """Rank ``rank`` of a world of ``dp x ep x pp`` ranks inside this one process, on torch's ``fake`` process group
    (every collective returns at once, with this rank's own data): the real layout code at any world size with no
    rank started and no data crossing (``moerl.plan``). Replaces the process group this process had, if any; one
    rank is ``World()``."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    if dist.is_initialized():
        dist.destroy_process_group()
    _forget_meshes()
    size = dp * ep * pp * cp
    if size == 1:
        return World(**pipeline)
    if not 0 <= rank < size:
        raise ConfigError(f"rank {rank} of a world of {size} ranks (dp {dp} x ep {ep} x pp {pp} x cp {cp})")
    dist.init_process_group("fake", rank=rank, world_size=size, store=dist.HashStore())
    return _on_mesh(rank, dp, ep, pp, cp, "cpu", pipeline)


def _forget_meshes() -> None:
    """DTensor caches its sharding decisions by mesh shape, and keeps the meshes (with their process groups) of
    the decisions it cached: a new world of the same shape would reach a destroyed group through them."""
    from torch.distributed.tensor import DTensor, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ fast path's (torch 2.12+)
    if clear is not None:
        clear()


def _on_mesh(rank: int, dp: int, ep: int, pp: int, cp: int, kind: str, pipeline: dict) -> World:
    """World ``rank`` with its ``(pp, dp, ep, cp)`` mesh on ``kind`` (the process group already formed)."""
    mesh = init_device_mesh(kind, (pp, dp, ep, cp), mesh_dim_names=("pp", "dp", "ep", "cp"))
    shards = mesh["dp", "ep", "cp"]._flatten("shard")
    rows = mesh["dp", "ep"]._flatten("data") if cp > 1 else shards
    size = dp * ep * pp * cp
    return World(rank, size, dp, ep, pp, mesh=mesh, data_mesh=shards, cp=cp, rows_mesh=rows, **pipeline)


def stalled(error: BaseException, timeout_s: float) -> TrainingStopped | None:
    """A collective that timed out (``error``) as the named fault it is: the sibling ranks of this launch that are
    stopped (SIGSTOP, a debugger) are named and ended, so the launcher stops the run instead of waiting on them.
    None when ``error`` is not a timeout."""
    text = str(error)
    if "timed out" not in text.lower() and "timeout" not in text.lower():
        return None
    stopped = []
    for pid, rank in _sibling_ranks():
        if proc_stopped(pid):
            stopped.append(f"trainer rank {rank} (pid {pid})")
            os.kill(pid, signal.SIGKILL)
    who = (
        f"{', '.join(stopped)} stopped answering (stopped: SIGSTOP?) and was ended"
        if stopped
        else ("a trainer rank did not answer")
    )
    first = (text.strip().splitlines() or [""])[0][:200]
    return TrainingStopped(
        f"{who}; rank {os.environ.get('RANK', '?')}'s collective waited parallel.timeout_s={timeout_s:g} s ({first}); "
        "the last checkpoint is intact: --resume continues"
    )


def _sibling_ranks() -> list[tuple[int, str]]:
    """The other ranks of this launch on this machine: processes of the same parent with a RANK in their env."""
    out = []
    for pid in proc_children(os.getppid()):
        try:
            env = dict(kv.split(b"=", 1) for kv in open(f"/proc/{pid}/environ", "rb").read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if pid != os.getpid() and b"RANK" in env:
            out.append((pid, env[b"RANK"].decode()))
    return out


def _die_with_the_launcher() -> None:
    """A rank outlives its launcher (killed with -9, it cannot stop its ranks) only until this notices: the rank's
    parent gone, the rank is reparented."""
    parent = os.getppid()
    _end_when(lambda: os.getppid() != parent, f"its launcher (pid {parent})", "?")


def die_with(pid: int, who: str) -> None:
    """End this process, naming ``who``, once process ``pid`` (on this machine) is gone: a Ray trainer rank whose
    driver was killed would otherwise train on until Ray notices its owner died."""
    _end_when(lambda: not proc_alive(pid), f"{who} (pid {pid})", "0")


def _end_when(gone, who: str, default_rank: str, every_s: float = 1.0) -> None:
    """A daemon thread that ends this rank, naming ``who``, once ``gone()`` holds."""

    def watch() -> None:
        while not gone():
            time.sleep(every_s)
        rank = os.environ.get("RANK", default_rank)
        print(f"moerl: trainer rank {rank}: {who} is gone; this rank stops", file=sys.stderr)
        os._exit(1)

    threading.Thread(target=watch, name="moerl-parent-watch", daemon=True).start()


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded DTensor (a collective: every rank calls it in the same order), else ``t``."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (a whole tensor every rank holds) laid out as ``param``: sharded the same way if it is a DTensor."""
    if isinstance(param, DTensor) and value.shape == param.shape:
        return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
    return value


def broadcast_bytes(data: bytes | None, src: int = 0, group=None) -> bytes:
    """Rank ``src``'s ``data`` on every rank of ``group``: a length, then the bytes. The others pass None, or their
    own bytes of the same kind, which the source's replace (on a fake world, where a collective returns this rank's
    own data, they are what this rank gets: ``moerl.plan``)."""
    n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(n, src, group=group)
    own = data is not None and 0 < len(data) == int(n)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if own else torch.empty(int(n), dtype=torch.uint8)
    if int(n):
        dist.broadcast(buf, src, group=group)
    return bytes(buf.numpy())


def broadcast_json(value=None, src: int = 0, group=None):
    """Rank ``src``'s JSON-able ``value`` on every rank of ``group`` (the others' ``value`` is replaced by it)."""
    return json.loads(broadcast_bytes(json.dumps(value).encode(), src, group))


def agreed_min(world: World, value: int) -> int:
    """The smallest of every rank's ``value`` (e.g. the index of the first bad tensor, in a list every rank shares)."""
    if world.size == 1:
        return value
    t = torch.tensor([value])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t)
