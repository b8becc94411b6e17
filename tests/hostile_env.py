"""An arithmetic environment whose reward function breaks: it raises on some problems and hangs on others.
(Its own module so the reward worker process can import it.)"""

import time

from moerl.envs.arithmetic import ArithmeticEnv
from moerl.envs.base import Problem
from moerl.envs.tool import CalculatorToolEnv


class HostileEnv(ArithmeticEnv):
    name = "hostile"

    def reward(self, problem, completion: str) -> float:
        if problem.answer == 3:
            raise RuntimeError("the grader crashed")
        if problem.answer == 4:
            time.sleep(60)  # the grader hangs
        return super().reward(problem, completion)


class HostileToolEnv(CalculatorToolEnv):
    """A multi-turn environment whose step() hangs on even answers and raises on odd ones."""

    name = "hostile_tool"

    def problems(self, n, seed, split="train"):
        return [Problem(f"1*{2 + i % 2}=?\n", 2 + i % 2) for i in range(n)]

    def step(self, state, completion):
        if state.problem.answer % 2 == 0:
            time.sleep(60)
        raise RuntimeError("the tool crashed")
