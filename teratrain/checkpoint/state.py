"""Turning training state into (tensors, JSON) and back: optimizer state, RNG streams.

Nothing here pickles: tensors go to safetensors, everything else must be JSON.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def optimizer_to_flat(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Any torch optimizer's state as {"optim.<param index>.<key>": tensor} plus JSON metadata."""
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"optim.{pid}.{k}"] = v
            else:
                scalars.setdefault(str(pid), {})[k] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_flat(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict] = {}
    for key, t in tensors.items():
        _, pid, k = key.split(".", 2)
        state.setdefault(int(pid), {})[k] = t
    for pid, d in meta["scalars"].items():
        state.setdefault(int(pid), {}).update(d)
    # Hyperparameters come from the optimizer as configured now (a resumed run may change weight
    # decay or betas); only which parameters each group holds comes from the checkpoint.
    current = opt.state_dict()["param_groups"]
    if len(current) != len(meta["param_groups"]):
        raise ValueError("optimizer parameter groups differ from the checkpoint's")
    groups = [{**{k: v for k, v in cur.items() if k != "params"}, "params": saved["params"]}
              for cur, saved in zip(current, meta["param_groups"])]
    opt.load_state_dict({"state": state, "param_groups": groups})


def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    """Every RNG stream a training step may draw from: Python, NumPy, torch CPU and CUDA."""
    tensors = {"rng.torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    meta = {"python": [version, list(internal), gauss], "numpy": _jsonable(np_state)}
    return tensors, meta


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    torch.set_rng_state(tensors["rng.torch_cpu"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(meta["numpy"])


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.integer):
        return int(x)
    return x
