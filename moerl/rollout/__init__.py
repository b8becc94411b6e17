"""What the RL loop talks to for rollouts: the InferenceEngine protocol and its implementations."""

from moerl.rollout.engine import InferenceEngine
from moerl.rollout.make import make_engine

__all__ = ["InferenceEngine", "make_engine"]
