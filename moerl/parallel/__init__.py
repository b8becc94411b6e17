"""Parallel plans for the trainer, applied from outside the model (torchtitan style): the ranks and their launch
(``world``), FSDP2 data parallel (``fsdp``), and the protocol by which rank 0 runs the loop while every rank trains
(``driver``)."""
