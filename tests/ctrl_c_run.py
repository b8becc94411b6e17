"""``moerl train ARGS`` (the CLI's own ``main``, as ``python -m moerl.cli train ARGS`` runs it) that sends itself a
real SIGINT at one named moment of step 3, as a terminal's Ctrl-C would land there:
``python ctrl_c_run.py MOMENT ARGS...`` (for tests/test_stops.py; the run needs ``algo.mini_batches=2``).

MOMENT: ``generating`` (step 3's rollouts are asked for: nothing of the step is in the state yet), ``training``
(between step 3's two optimizer steps), ``syncing`` (step 3 trained, its weights on their way to the engine, its
metrics row not written yet), ``twice`` (two Ctrl-Cs between the optimizer steps: stop now), ``unheld`` (the
control: between the optimizer steps a KeyboardInterrupt is raised where the signal would land, as Python's own
SIGINT handler does, the way moerl took a Ctrl-C before it held it for the step's end).
"""

import os
import signal
import sys

from moerl import cli, loop
from moerl.rollout.generator import Generator
from moerl.trainer.policy import Policy

STEP = 2  # 0-based: the run's third step

moment, argv = sys.argv[1], sys.argv[2:]
# Ctrl-C as in a terminal: a job started in the background inherits SIGINT ignored, and Python keeps it so
signal.signal(signal.SIGINT, signal.default_int_handler)
trained_in_step = 0


def ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def collect(self, step, *args, **kwargs):
    if moment == "generating" and step == STEP:
        ctrl_c()
    return real_collect(self, step, *args, **kwargs)


def train_step(self, *args, **kwargs):
    global trained_in_step
    if self.stop_state.get("step") == STEP:
        trained_in_step += 1
        if trained_in_step == 2:  # the step's first optimizer step is done: its weights are no step's now
            if moment in ("training", "twice"):
                ctrl_c()
            if moment == "twice":
                ctrl_c()
            if moment == "unheld":
                raise KeyboardInterrupt
    return real_train_step(self, *args, **kwargs)


def push(gen, policy, sync, step, *args, **kwargs):
    if moment == "syncing" and step == STEP:
        ctrl_c()
    return real_push(gen, policy, sync, step, *args, **kwargs)


real_collect, real_train_step, real_push = Generator.collect, Policy.train_step, loop.push
Generator.collect, Policy.train_step, loop.push = collect, train_step, push
sys.argv = ["moerl", *argv]  # what the run says to continue with
sys.exit(cli.main(argv))
