"""One trainer step on a fixed batch, run by every rank of a torchrun launch (or alone):
``python dp_check.py CKPT MODE DTYPE OUT DP,EP,PP[,CP] [extras]``, or several on one launch (one world, the cases in
turn: ``python dp_check.py --cases CKPT DP,EP,PP[,CP] SCHEDULE CASES.json``, a list of ``[mode, dtype, out,
[extras]]``; they share the launch's schedule). Rank 0 writes the step's numbers, the logprobs before and after it,
and after it the whole weights (w/), optimizer state (o/) and weight-sync tensors (s/), to OUT (JSON +
safetensors).

Extras: ``layout=shared_outer`` (expert adapters), ``schedule=S`` (pipeline), ``load=DIR`` (a checkpoint loaded
first), ``dump`` (write the state as loaded and stop), ``steps=N``, ``save=DIR`` (a checkpoint saved after the first
step), ``ac=full|selective`` (activation checkpointing), ``tokens=N`` (micro-batches of at most N tokens, no row
limit), ``offload`` (``policy.cpu_offload``: FSDP2's CPUOffloadPolicy), ``reads`` (each rank writes what it read of
the checkpoint to OUT.reads<rank>.json, and stops), ``model=DIR`` (that checkpoint instead of CKPT), ``unpacked``
(``policy.packing=false``: rows as they are, padded). Negative
controls: ``mean``, FSDP's default mean over ranks
instead of moerl's sum; ``perturb``, the last expert of the first MoE layer moved by 1e-3 on the rank that holds it
(the last ep rank); ``wrong_columns``, the last pipeline stage replays the first stage's MoE layers' columns instead
of its own; ``untie``, a tied embedding's two pipeline copies each keep their own gradient; ``cp_local``, with
context parallelism each rank's attention layers attend within its own part of the tokens (the plain core).
"""

import json
import sys

import torch
from safetensors.torch import save_file

from moerl.model.lora import LoraConfig
from moerl.parallel.world import init_world
from moerl.trainer import Batch, OptimConfig, Policy, PolicyConfig
from moerl.trainer.checkpoint import save_checkpoint, shards_of_save
from moerl.trainer.losses import PolicyLossConfig, make_policy_loss

LR = 1e-2  # large enough that one AdamW step moves the logprobs visibly
PART_BYTES = 2**16  # a sync's parts: 2 experts of the tiny model's in bf16, 1 in fp32, 3 in MXFP8 (data + scales)


def fixed_batch(num_moe_layers: int, top_k: int, num_experts: int) -> Batch:
    """7 rows of 12 tokens (ragged: right padding), a response mask, advantages, and replayed experts for R3."""
    g = torch.Generator().manual_seed(0)
    b, t = 7, 12
    ids = torch.randint(4, 100, (b, t), generator=g)
    lengths = torch.tensor([12, 9, 12, 7, 11, 12, 8])
    attn = (torch.arange(t)[None] < lengths[:, None]).long()
    loss_mask = attn.clone()
    loss_mask[:, :4] = 0
    replay = torch.rand(b, t - 1, num_moe_layers, num_experts, generator=g).topk(top_k, -1).indices.to(torch.int16)
    replay[~attn[:, 1:].bool()] = -1  # padding rows: "route yourself"
    adv = torch.randn(b, generator=g)
    return Batch(ids * attn, attn, loss_mask, replay, {"advantages": adv})


def _write(world, policy, out: str, tensors: dict, stats: dict | None = None) -> None:
    """Rank 0 writes ``tensors``, the policy's whole weights (w/) and optimizer state (o/) and the step's numbers."""
    weights, opt = policy.full_state()
    # what a weight sync sends the engine (experts split over ranks in parts of at most PART_BYTES)
    sent = {f"s/{n}": t.clone() for n, t in policy.sync_tensors(part_bytes=PART_BYTES)}
    names = list(weights)
    tensors |= {f"w/{n}": t.contiguous() for n, t in weights.items()}
    tensors |= {f"o/{names[i]}/{k}": v.contiguous() for i, st in opt["state"].items() for k, v in st.items()}
    tensors |= sent
    if world.driver:
        save_file(tensors, out + ".st")
        with open(out, "w") as f:
            json.dump({"loss": stats["loss"], "grad_norm": stats["grad_norm"]} if stats else {}, f)


def world_of(layout: str, schedule: str):
    """This launch's world of ``layout`` (``dp,ep,pp`` or ``dp,ep,pp,cp``)."""
    dp, ep, pp, cp = ([int(n) for n in layout.split(",")] + [1])[:4]
    return init_world(dp, ep, pp, cp=cp, schedule=schedule)


def main(ckpt: str, mode: str, dtype: str, out: str, layout: str, *extra: str) -> None:
    world = world_of(layout, schedule_of(extra))
    step(world, ckpt, mode, dtype, out, *extra)
    world.close()


def schedule_of(extra) -> str:
    return next((e.split("=")[1] for e in extra if e.startswith("schedule=")), "1f1b")


def cases(ckpt: str, layout: str, schedule: str, spec: str) -> None:
    """Every case of ``spec`` (JSON: ``[mode, dtype, out, [extras]]``) on one world: a launch's start-up once."""
    world = world_of(layout, schedule)
    for mode, dtype, out, extra in json.loads(open(spec).read()):
        assert schedule_of(extra) == schedule, (extra, schedule)
        step(world, ckpt, mode, dtype, out, *extra)
    world.close()


def step(world, ckpt: str, mode: str, dtype: str, out: str, *extra: str) -> None:
    """One step of case (``mode``, ``dtype``, ``extra``) on ``world``; rank 0 writes it to ``out``."""
    mean = "mean" in extra
    torch.manual_seed(0)  # the same adapters on every rank
    lora = LoraConfig(layout="shared_outer" if "layout=shared_outer" in extra else "per_expert")
    opt = dict(e.split("=", 1) for e in extra if "=" in e)
    cfg = PolicyConfig(
        mode=mode,
        dtype=dtype,
        micro_batch_size=0 if "tokens" in opt else 2,  # a token budget alone cuts the micro-batches
        max_tokens_per_micro_batch=int(opt.get("tokens", 0)),
        optim=OptimConfig(lr=LR),
        lora=lora,
        activation_checkpointing=opt.get("ac", "none"),
        cpu_offload="offload" in extra,
        packing="unpacked" not in extra,
    )
    policy = Policy(opt.get("model", ckpt), cfg, world)
    if "reads" in extra:  # what each rank read of the checkpoint, and stop
        with open(f"{out}.reads{world.rank}.json", "w") as f:
            pipe = policy.layout.pipeline
            held = sorted(pipe.plan.layers) if pipe is not None else list(range(policy.model.config.num_layers))
            json.dump({"ep_rank": world.ep_rank, "layers": held, "reads": policy.checkpoint_reads}, f)
        return
    if mean:
        from moerl.parallel.fsdp import fsdp_units

        for unit in fsdp_units(*policy.layout.roots):
            unit.set_gradient_divide_factor(float(world.size))
    if "perturb" in extra and world.ep_rank == world.ep - 1:
        with torch.no_grad():
            policy.model.layers[policy.model.moe_layer_ids[0]].mlp.experts.gate_up_proj[-1] += 1e-3
    if "wrong_columns" in extra and policy.layout.pipeline.last:
        policy.layout.pipeline.modules[-1].columns = list(range(len(policy.layout.pipeline.modules[-1].columns)))
    if "cp_local" in extra:
        from moerl.model.attention import attend

        policy.layout.runner(policy.model)  # installs the split cores: put the plain ones back
        for module in policy.model.modules():
            if hasattr(module, "core"):
                module.core = attend
    if "untie" in extra:
        policy.layout.pipeline.tied = False
    if "load" in opt:
        policy.load(opt["load"])
    if "dump" in extra:  # the state as loaded
        return _write(world, policy, out, {})
    mcfg = policy.model.config
    batch = fixed_batch(len(mcfg.route_layers()), mcfg.top_k, mcfg.num_experts + mcfg.zero_experts)
    first_old = None
    for i in range(int(opt.get("steps", 1))):  # on-policy steps: the old logprobs are the current policy's
        batch.extras["old_logprobs"], _ = policy.forward_logprobs(batch, replay=True)
        first_old = batch.extras["old_logprobs"] if first_old is None else first_old
        stats = policy.train_step(batch, make_policy_loss(PolicyLossConfig()), replay=True)
        if i == 0 and "save" in opt:  # rank 0 saves, every rank writes its part
            if world.driver:
                save_checkpoint(opt["save"], policy)
            else:
                policy.save_shards(shards_of_save(opt["save"]))
    new, _ = policy.forward_logprobs(batch, replay=True)
    _write(world, policy, out, {"old_logprobs": first_old, "new_logprobs": new}, stats)


if __name__ == "__main__":
    cases(*sys.argv[2:]) if sys.argv[1] == "--cases" else main(*sys.argv[1:])
