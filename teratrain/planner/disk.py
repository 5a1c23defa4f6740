"""Bytes of one checkpoint on disk, over every rank that writes a piece of it: what a run holds against
its run directory's free space before its first step (startup.py `check_disk`).

A checkpoint holds each logical tensor once (checkpoint/training.py: the first holder of a replica or
a tied copy writes it), in the form training continues from (checkpoint/holdings.py):
- every parameter's value: 4 bytes (the fp32 master where the engine keeps one, else the parameter,
  which is fp32 without masters: memory/precision.py); a frozen LoRA base in lora.base_dtype;
- the optimizer state of the trainable ones, fp32 (states.optimizer_elems: AdamW's two moments, SGD's
  momentum, Adafactor's and SM3's factors, whole 1-D pieces under ZeRO), and AdamW's and Adafactor's
  fp32 `step` per parameter tensor;
- local SGD (replicas differ between syncs): every data-parallel replica's.
Not counted: each rank's RNG state and JSON (kilobytes) and the safetensors headers.
"""

from __future__ import annotations

import math
from typing import Iterable

from teratrain.parallel.flat import WHOLE_PARAM_OPTIMIZERS
from teratrain.planner.layout import Layout, ModelShape, Training
from teratrain.planner.local import local_tensors
from teratrain.planner.states import optimizer_elems


def checkpoint_bytes(shape: ModelShape, train: Training, lay: Layout, sync: str = "allreduce") -> int:
    """Bytes of one checkpoint of teratrain's decoder of `shape` (module docstring)."""
    tensors = local_tensors(shape, 1, False, lay.tp_form, train.lora)  # the whole model, LoRA adapters included
    return params_checkpoint_bytes(((t.shape, t.trainable) for t in tensors), train, lay, sync)


def params_checkpoint_bytes(params: Iterable[tuple[tuple[int, ...], bool]], train: Training, lay: Layout,
                            sync: str = "allreduce") -> int:
    """Bytes of one checkpoint of a model of `params` ((global shape, trainable) each, tied ones once)."""
    params = list(params)
    trained = [tuple(s) for s, trainable in params if trainable]
    n_trained = sum(map(math.prod, trained))
    frozen = sum(math.prod(s) for s, trainable in params if not trainable)
    sharded = lay.zero >= 1 and train.optimizer not in WHOLE_PARAM_OPTIMIZERS
    steps = 4 * len(trained) if train.optimizer in ("adamw", "adafactor") else 0
    one = 4 * n_trained + train.frozen_width * frozen + 4 * optimizer_elems(train, trained, n_trained, sharded) + steps
    return one * (lay.dp if sync == "local-sgd" else 1)
