"""Preference alignment: DPO (`laden dpo`) and reward-model training (`laden rw`), as AReaL defines them.

Both train on pairs of one prompt's chosen and rejected completions (`laden.align.data`), packed
as two consecutive documents of one micro-batch, through every engine's `TrainEngine` with a pair
objective on the final hidden states (`laden.align.objectives`); the run itself (checkpoints,
resume, evaluation schedule, metrics, export) is `laden sft`'s loop (`laden.sft.trainer`) with the
pair task of `laden.align.task`.
"""
