"""Parallel plans for the trainer, applied from outside the model (torchtitan style): the ranks and their launch
(``world``), the split of one model over them (``layout``: ``parallelize`` -> ``Layout``) and its parts — FSDP2
data parallel (``fsdp``), expert parallel (``expert``), pipeline stages (``pipeline``), rows (``rows``), sharded
checkpoints (``shards``). Nothing here imports the trainer: the trainer's rank-0 driver is ``moerl.trainer.driver``.
"""
