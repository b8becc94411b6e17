"""moerl: reinforcement-learning post-training for Mixture-of-Experts language models."""

__version__ = "0.1.0"
