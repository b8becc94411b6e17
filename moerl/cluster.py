"""``cluster.backend: ray``: the run's trainer ranks and rollout engines as Ray actors in one placement group.

The driver (``moerl train``) joins a running Ray cluster (``cluster.address``) or starts a local one, reserves a
placement group (one bundle per trainer rank; ``disaggregated``: one more per engine, ``colocated``: engine i shares
rank i's bundle and its CPUs, the two taking turns), starts the ranks and runs the ordinary loop on them: rank 0
drives it and starts the engine actors in their bundles. A rank that fails or dies stops every rank (the run keeps
its last checkpoint: ``--resume`` continues); an engine actor that dies is restarted by Ray and brought back by the
pool (``moerl.rollout.pool``).
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from moerl import errors
from moerl.errors import ConfigError, TrainingStopped
from moerl.parallel.ends import END_S

PLACEMENT_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 10.0  # an address that does not answer within this is refused by name


@dataclass(slots=True)
class EnginePlacement:
    """Where rank 0 starts the engine actors: ``group``'s bundles ``engine_bundles``, ``engine_cpus`` and
    ``engine_gpus`` each."""

    group: object  # ray.util.placement_group.PlacementGroup
    engine_bundles: list[int]
    engine_cpus: float
    engine_threads: int
    engine_gpus: float = 0.0


class TrainerRank:
    """One trainer rank as a Ray actor: it runs ``moerl.loop.train`` as a torchrun rank would."""

    def __init__(self, threads: int):
        torch.set_num_threads(max(1, threads))

    def where(self) -> dict:
        import ray

        with socket.socket() as s:  # a free port for the process group's rendezvous, on rank 0's node
            s.bind(("", 0))
            port = s.getsockname()[1]
        ctx = ray.get_runtime_context()
        return {"ip": ray.util.get_node_ip_address(), "port": port, "pid": os.getpid(), "node": ctx.get_node_id()}

    def run(self, cfg: dict, resume: bool, overwrite: bool, rank: int, size: int, master: dict, engines):
        import ray

        from moerl.config import from_dict
        from moerl.loop import train
        from moerl.parallel.world import die_with
        from moerl.run_config import RunConfig

        if master["driver"]["node"] == ray.get_runtime_context().get_node_id():  # a killed driver ends its ranks
            die_with(master["driver"]["pid"], "its Ray driver")

        if size > 1:  # the environment torchrun would give this rank
            if master["one_node"]:  # the ranks talk over loopback only (across nodes they need the network)
                os.environ["GLOO_SOCKET_IFNAME"] = "lo"
            os.environ |= {
                "RANK": str(rank),
                "WORLD_SIZE": str(size),
                # Ray shows an actor its own GPUs only (as cuda:0 ...): on its GPUs each rank is alone
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1" if master["one_node"] else master["ip"],
                "MASTER_PORT": str(master["port"]),
            }
        return train(from_dict(RunConfig, cfg), resume=resume, overwrite=overwrite, engines=engines)


def bundles(cfg) -> tuple[list[dict], EnginePlacement]:
    """The placement group's bundles for ``cfg`` and where the engines go in it (the group filled in later)."""
    c, world, n = cfg.cluster, cfg.parallel.size, cfg.rollout.num_engines
    ranks = [_bundle(c.cpus_per_trainer, c.gpus_per_trainer) for _ in range(world)]
    if c.placement == "colocated":  # engine i shares rank (i mod world)'s CPUs and GPU with the most any rank has
        parts = 1 + -(-n // world)
        threads = cfg.rollout.engine_threads or c.cpus_per_trainer
        where = EnginePlacement(None, [i % world for i in range(n)], c.cpus_per_trainer / parts, threads)
        where.engine_gpus = c.gpus_per_trainer / parts
        return ranks, where
    threads = cfg.rollout.engine_threads or c.cpus_per_engine
    where = EnginePlacement(None, list(range(world, world + n)), float(c.cpus_per_engine), threads, c.gpus_per_engine)
    return ranks + [_bundle(c.cpus_per_engine, c.gpus_per_engine) for _ in range(n)], where


def _bundle(cpus: float, gpus: float) -> dict:
    """A placement bundle: CPUs, and GPUs when asked for (Ray then shows the actor its GPUs only)."""
    return {"CPU": float(cpus)} | ({"GPU": float(gpus)} if gpus else {})


def run_on_ray(cfg, resume: bool = False, overwrite: bool = False) -> dict:
    """Run ``cfg`` on Ray (see the module); returns rank 0's summary. Raises what a rank raised, naming the rank, or
    TrainingStopped when a rank died. Ray's own log lines in this process go to the run's libraries.log."""
    try:
        import ray  # noqa: F401  (imported first: it sets up its logger, which held_lines then takes over)
    except ImportError as e:
        raise ConfigError(
            f"cluster.backend: ray needs Ray, which is not installed here ({e}); install moerl's extra: "
            "pip install -e '.[ray]' (make test installs it)"
        ) from None
    from moerl.logs import held_lines

    with held_lines("ray", cfg.run_dir):
        return _run_on_ray(cfg, resume, overwrite)


def _run_on_ray(cfg, resume: bool, overwrite: bool) -> dict:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from moerl.config import to_dict

    c = cfg.cluster
    started = not ray.is_initialized()
    own = init_ray(c.address, c.runtime_env) if started else None
    specs, where = bundles(cfg)
    for kind, per_trainer, per_engine in (
        ("CPU", c.cpus_per_trainer, c.cpus_per_engine),
        ("GPU", c.gpus_per_trainer, c.gpus_per_engine),
    ):
        need, have = sum(b.get(kind, 0) for b in specs), ray.cluster_resources().get(kind, 0)
        if need > have:
            if started:
                ray.shutdown()
            if own is not None:
                shutil.rmtree(own, ignore_errors=True)
            key = f"cluster.{kind.lower()}s_per"
            engines = "" if c.placement == "colocated" else f", {key}_engine={per_engine:g}"
            raise ConfigError(
                f"cluster: {cfg.parallel.size} trainer rank(s) x {key}_trainer={per_trainer:g} and "
                f"{cfg.rollout.num_engines} engine(s) ({c.placement}{engines}) needs {need:g} {kind}s, the cluster "
                f"has {have:g}"
            )
    group = placement_group(specs, strategy="PACK")
    ranks = []
    try:
        ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise ConfigError(
                f"cluster: the placement group {specs} ({cfg.parallel.size} trainer rank(s), "
                f"{cfg.rollout.num_engines} engine(s), cluster.placement={c.placement}) cannot be placed within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s; the cluster has {ray.available_resources().get('CPU', 0):g} free CPUs "
                "(lower cluster.cpus_per_trainer / cpus_per_engine or add nodes)"
            )
        where.group = group
        colocated = c.placement == "colocated"
        share = where.engine_cpus if colocated else 0.0  # a colocated rank leaves its engines their part
        gpu_share = where.engine_gpus if colocated else 0.0
        actor = ray.remote(TrainerRank)
        for r in range(cfg.parallel.size):
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=r)
            cpus = c.cpus_per_trainer - share * where.engine_bundles.count(r)
            gpus = c.gpus_per_trainer - gpu_share * where.engine_bundles.count(r)
            options = {"num_cpus": cpus, "num_gpus": gpus, "scheduling_strategy": strategy}
            ranks.append(actor.options(**options).remote(c.cpus_per_trainer))
        found = ray.get([a.where.remote() for a in ranks])
        driver = {"node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}
        master = found[0] | {"one_node": len({f["node"] for f in found}) == 1, "driver": driver}
        cfg_dict = to_dict(cfg)
        runs = {
            ranks[r].run.remote(cfg_dict, resume, overwrite, r, len(ranks), master, where if r == 0 else None): r
            for r in range(len(ranks))
        }
        return await_ranks(runs, [f["pid"] for f in found], cfg.run_dir)
    finally:
        for a in ranks:  # the engines die with rank 0, their owner
            ray.kill(a, no_restart=True)
        remove_placement_group(group)
        if started:
            ray.shutdown()
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)


def init_ray(address: str, runtime_env: dict | None = None) -> str | None:
    """Join the Ray cluster at ``address`` (``auto``: the one ``RAY_ADDRESS`` or ``ray start`` names), checked to
    answer within ``CONNECT_TIMEOUT_S`` first (Ray itself retries an address nobody serves for ever); or with
    ``address`` empty start a fresh local cluster in a directory of moerl's own (returned, for removal after
    ``ray.shutdown``), never one a stale ``ray_current_cluster`` file names."""
    import ray

    common = {"runtime_env": runtime_env or None, "include_dashboard": False, "logging_level": "warning"}
    if not address:
        own = tempfile.mkdtemp(prefix="moerl-ray-")
        ray.init(address="local", _temp_dir=own, **common)
        return own
    target = _resolve(address)
    host, _, port = target.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"cluster.address={address!r}: no Ray cluster answers at {target} within {CONNECT_TIMEOUT_S:.0f} s "
            f"({getattr(e, 'strerror', None) or e}); start one (ray start --head) or leave cluster.address empty "
            "for a local cluster of the run's own"
        ) from None
    ray.init(address=target, **common)
    return None


def _resolve(address: str) -> str:
    """``auto`` as the ``host:port`` it means: ``RAY_ADDRESS``, else the cluster ``ray start`` recorded."""
    if address != "auto":
        return address
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    recorded = os.path.join(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir(), "ray", "ray_current_cluster")
    try:
        with open(recorded) as f:
            return f.read(256).strip()
    except OSError:
        raise ConfigError(
            "cluster.address='auto': no running Ray cluster is recorded on this machine (RAY_ADDRESS unset, no "
            f"{recorded}); start one (ray start --head) or leave cluster.address empty for a local cluster of the "
            "run's own"
        ) from None


def await_ranks(runs: dict, pids: list[int], run_dir: str, end_s: float = END_S):
    """Rank 0's return value once every rank's ``run`` (``runs``: Ray object ref -> rank) has returned; the first
    rank's error, named, when one fails. Every rank returns after the run's final barrier: once one has, the others
    have ``end_s`` seconds (then they are left to the caller, which kills the actors)."""
    import ray

    summary, pending, first = None, list(runs), None
    while pending:
        left = None if first is None else max(first[1] + end_s - time.monotonic(), 0.0)
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not done:
            late = ", ".join(str(r) for r in sorted(runs[p] for p in pending))
            print(f"moerl: trainer rank(s) {late} still running {end_s:g} s after rank {first[0]} returned; "
                  "stopping them", file=sys.stderr, flush=True)  # fmt: skip
            break
        r = runs[done[0]]
        first = first or (r, time.monotonic())
        try:
            out = ray.get(done[0])
        except ray.exceptions.RayTaskError as e:
            raise _rank_error(r, e) from None
        except ray.exceptions.RayActorError as e:
            raise TrainingStopped(
                f"trainer rank {r} (Ray actor, pid {pids[r]}) died: {type(e).__name__}; the other ranks were "
                f"stopped; the run's last checkpoint is in {run_dir}/checkpoint: continue with --resume"
            ) from None
        if r == 0:
            summary = out
    if summary is None:  # rank 0 past the final barrier but not returned: its results were written, not said
        raise TrainingStopped(
            f"trainer rank 0 did not return within {end_s:g} s of rank {first[0]}; the run passed its final barrier: "
            f"its results and checkpoint are in {run_dir}"
        )
    return summary


def _rank_error(rank: int, e) -> Exception:
    """What rank ``rank`` raised, as moerl's own error type when it was one, naming the rank."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, errors.MoerlError):
        return type(cause)(f"trainer rank {rank}: {cause}")
    what = f"{type(cause).__name__}: {cause}" if cause is not None else str(e).splitlines()[0]
    return TrainingStopped(f"trainer rank {rank} failed: {what}")
