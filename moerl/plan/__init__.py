"""moerl plan: a run's memory and weight-sync traffic per rank, at real model and world sizes, before it starts."""
