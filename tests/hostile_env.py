"""An arithmetic environment whose reward function breaks: it raises on some problems and hangs on others.
(Its own module so the reward worker process can import it.)"""

import time

from moerl.envs.arithmetic import ArithmeticEnv


class HostileEnv(ArithmeticEnv):
    name = "hostile"

    def reward(self, problem, completion: str) -> float:
        if problem.answer == 3:
            raise RuntimeError("the grader crashed")
        if problem.answer == 4:
            time.sleep(60)  # the grader hangs
        return super().reward(problem, completion)
