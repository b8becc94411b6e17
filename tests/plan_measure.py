"""The memory a real trainer rank holds in a training step, counted on real tensors, beside which ``moerl plan``'s
figure for the same rank is checked: ``python plan_measure.py CKPT OUT DP,EP,PP[,CP] CASE [CASE ...]``, alone or on each
rank of a torchrun launch; a CASE is key=value overrides joined by spaces (one argument). For each case every rank
builds the run's Policy from CKPT on its real world (gloo), trains two steps on the plan's worst-case batch (the
first makes the optimizer's state) and writes the second step's peak split by category (``moerl.plan.memory``) to
OUT.caseI.rankN.json."""

import json
import sys
from dataclasses import replace

from moerl.config import load_config
from moerl.parallel.world import init_world
from moerl.plan.memory import Memory
from moerl.plan.rank import count_the_step, held, traced_rows, worst_batch
from moerl.run_config import RunConfig
from moerl.trainer import Policy
from moerl.trainer.losses import make_policy_loss


def measure(ckpt: str, run: RunConfig, world) -> dict[str, int]:
    policy = Policy(ckpt, replace(run.policy, compile=False, device="cpu"), world)
    batch = worst_batch(policy.model.config, run, traced_rows(run, world))
    loss = make_policy_loss(run.algo.loss)
    policy.train_step(batch, loss, replay=run.algo.r3, entropy=run.algo.loss.entropy)
    memory = Memory(held(policy))
    with memory:
        hooks = count_the_step(policy, memory)
        policy.train_step(batch, loss, replay=run.algo.r3, entropy=run.algo.loss.entropy)
        for hook in hooks:
            hook.remove()
    return dict(memory.peak.bytes)


def main(ckpt: str, out: str, layout: str, *cases: str) -> None:
    dp, ep, pp, cp = ([int(n) for n in layout.split(",")] + [1])[:4]
    world = None
    for i, case in enumerate(cases):
        over = [f"parallel.dp={dp}", f"parallel.ep={ep}", f"parallel.pp={pp}", f"parallel.cp={cp}", *case.split()]
        run = load_config(RunConfig, None, over)
        if world is None:
            p = run.parallel
            world = init_world(
                dp, ep, pp, cp=cp, schedule=p.schedule, microbatches=p.microbatches, stages=p.stages or None
            )
        with open(f"{out}.case{i}.rank{world.rank}.json", "w") as f:
            json.dump(measure(ckpt, run, world), f)
    world.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
