"""Models of your own under parallelize() (the protocol: models/protocol.py): which strategies they
get, where their first values come from, and their tied parameters.

A model built on a real device keeps its values: they are taken as whole tensors by global name and
the model is moved to the meta device, so every strategy then materializes it the one way it does
teratrain's own model (each rank its pieces). A parameter that two modules share (an output layer
tied to the input embedding) is registered once while the strategies run (engines create new
parameter objects, which would untie it) and its alias pointed at the engine's parameter afterwards.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from teratrain.checkpoint.pieces import WholeTensors
from teratrain.config_base import ConfigError
from teratrain.models.protocol import is_builtin

OWN_LAYERS_ONLY = "it rewrites teratrain's own decoder (models/transformer.py)"


def check_model(model: nn.Module, cfg) -> None:
    """Refuse, in one sentence, what a model of your own cannot get."""
    if is_builtin(model):
        return
    p, policy = cfg.parallel, cfg.memory.recompute
    for key in ("tp", "pp", "ep"):
        if getattr(p, key) > 1:
            raise ConfigError(f"parallel.{key}={getattr(p, key)} needs teratrain's own layers ({OWN_LAYERS_ONLY}); "
                              f"set parallel.{key}=1 for a model of your own (it gets dp, ZeRO 1-3 and offload).")
    if cfg.lora.rank:
        raise ConfigError(f"lora.rank={cfg.lora.rank} adds adapters to teratrain's own block linears ({OWN_LAYERS_ONLY}); "
                          "set lora.rank=0 for a model of your own.")
    if policy not in ("none", "full"):
        raise ConfigError(f"memory.recompute={policy} runs teratrain's own block stack; use memory.recompute=full "
                          "(each block of your model recomputed in backward) or none.")


def initial_values(model: nn.Module, default: Callable[[], Callable]):
    """The init_fn of `model`: the values it was built with (then it moves to the meta device), its
    own `init_parameter(tensor, name)`, or `default()` (teratrain's, by name and seed)."""
    if any(t.device.type != "meta" for t in model.parameters()):
        values = WholeTensors({n: p.detach() for n, p in model.named_parameters()},
                              {n: b.detach() for n, b in model.named_buffers()})
        model.to("meta")
        return values
    return getattr(model, "init_parameter", None) or default()


def untie(model: nn.Module) -> list[tuple[str, str]]:
    """Remove every second registration of a shared parameter (until `retie`), so strategies see one
    parameter under one name; returns (alias, name) pairs."""
    first, aliases = {}, []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases.append((name, first[id(p)]))
        else:
            first[id(p)] = name
    for alias, _ in aliases:
        _set(model, alias, None)
    return aliases


def retie(model: nn.Module, aliases: list[tuple[str, str]]) -> None:
    """Point each alias at the (possibly new) parameter object of the name it shares."""
    for alias, name in aliases:
        _set(model, alias, model.get_parameter(name))


def _set(model: nn.Module, name: str, value) -> None:
    owner, _, leaf = name.rpartition(".")
    (model.get_submodule(owner) if owner else model)._parameters[leaf] = value
