"""A training step that runs out of memory on one rank: ``python oom_check.py CKPT OUT_DIR DP CAPPED_RANK`` (alone for
DP 1, else under torchrun). Every rank trains a small batch; then the capped rank's address space is limited
(RLIMIT_AS) to what it holds plus ``MARGIN``, and a batch whose activations need far more is trained. The rank that
runs out writes its error's message to OUT_DIR/oom.txt and exits 2 (as ``moerl``'s CLI does); one process also
saves the state before the step (to OUT_DIR/stop), which is written to OUT_DIR/before.safetensors to compare."""

import resource
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from moerl.errors import OutOfMemory
from moerl.parallel.world import init_world
from moerl.trainer import Batch, Policy, PolicyConfig
from moerl.trainer.losses import PolicyLossConfig, make_policy_loss

MARGIN = 64 * 2**20  # the big batch's fp32 logits alone are 16 x 4096 x 128 x 4 B = 32 MiB, its activations ~1 GiB


def batch(rows: int, tokens: int) -> Batch:
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(0, 128, (rows, tokens), generator=g)
    ones = torch.ones(rows, tokens, dtype=torch.long)
    extras = {"advantages": torch.randn(rows, generator=g), "old_logprobs": torch.zeros(rows, tokens)}
    return Batch(ids, ones, ones.clone(), None, extras, total_tokens=rows * tokens, total_seqs=rows)


def address_space() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def main(ckpt: str, out: str, dp: str, capped: str) -> None:
    out_dir = Path(out)
    world = init_world(int(dp))
    cfg = PolicyConfig(mode="full", dtype="float32", micro_batch_size=16, max_tokens_per_micro_batch=0)  # 16 rows
    policy = Policy(ckpt, cfg, world)
    policy.stop_checkpoint_dir = out_dir / "stop"
    loss = make_policy_loss(PolicyLossConfig())
    policy.train_step(batch(4, 16), loss, replay=False)
    if world.rank == 0 and world.size == 1:
        save_file({n: t.detach().clone() for n, t in policy.trainable_state().items()}, out_dir / "before.safetensors")
    if world.rank == int(capped):
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (address_space() + MARGIN, hard))
    try:
        policy.train_step(batch(16, 4096), loss, replay=False)
    except OutOfMemory as e:
        (out_dir / "oom.txt").write_text(str(e))
        print(f"moerl: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    world.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
