"""The model protocol: what teratrain needs from a model to parallelize and train it, so a decoder of
your own (or a transformers Llama/GPT-2 module, through `CausalLM`) trains like the built-in one.

1. Loss. `model(tokens, targets)` returns the mean next-token loss, a 0-d tensor; tokens and targets
   are int64 (B, T), targets already shifted by one (targets[:, t] = tokens[:, t + 1]). Compute the
   cross-entropy in fp32 (`models.transformer.lm_loss`): the trainer runs forward under autocast.
2. Names. `named_parameters()` names are the global names: checkpoints store every parameter and
   optimizer moment under them, and the initial value of a parameter depends on its name and the
   seed only, so every layout starts from the same model.
3. Blocks. The repeated layers are `model.teratrain_blocks()` (a list of (qualified module name,
   module)) when the model defines it, else the first ModuleList/ModuleDict among `layers`,
   `model.layers` (HF Llama) and `transformer.h` (HF GPT-2). ZeRO-3 gathers one block's parameters
   just before it runs and frees them after it; `memory.recompute=full` recomputes each block in
   backward. Without blocks ZeRO-3 still works, gathering the whole model at once.
4. Init. Build the model on the meta device (no memory) and define `init_parameter(tensor, name)`,
   which fills a whole parameter in place (else teratrain's init by name: norms 1, biases 0, other
   tensors N(0, model.init_std)), and `init_buffers(device)` if it has buffers. Or build it on a real
   device: its values (parameters and buffers) are kept, each rank taking its pieces of them.

Strategies a model of your own gets: data parallelism (all-reduce, local SGD, parameter server),
ZeRO 1-3 with offload, mixed precision, `memory.recompute=full`, checkpoints that reshard to other
dp/ZeRO layouts, torch.compile. Those that rewrite layers need teratrain's own decoder
(models/transformer.py) and are refused with one sentence: tensor and sequence parallelism (they swap
its linear layers by name), pipeline and expert parallelism, the every-k/sqrt/selective recompute
policies (they run its block stack), and `teratrain generate`/`export`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from teratrain.models.transformer import Transformer, flops_per_token, lm_loss

BLOCK_PATHS = ("layers", "model.layers", "transformer.h")


def blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every block, in order (see 3. above)."""
    find = getattr(model, "teratrain_blocks", None)
    if find is not None:
        return list(find())
    for path in BLOCK_PATHS:
        try:
            stack = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(stack, (nn.ModuleList, nn.ModuleDict)):
            return [(f"{path}.{key}", block) for key, block in stack.named_children()]
    return []


def is_builtin(model: nn.Module) -> bool:
    return isinstance(model, Transformer)


def init_buffers(model: nn.Module, device, kept: dict[str, torch.Tensor] | None = None) -> None:
    """Fill the buffers of a model whose parameters were just materialized on `device`: its own
    `init_buffers`, else the values it was built with (`kept`)."""
    if hasattr(model, "init_buffers"):
        model.init_buffers(device)
        return
    with torch.no_grad():
        for name, buf in model.named_buffers():
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner) if owner else model
            if kept is None or name not in kept:
                raise ValueError(f"buffer {name} of a meta-device model has no value: define init_buffers(device) "
                                 "or build the model on a real device")
            module._buffers[leaf] = kept[name].to(device)


def model_flops_per_token(model: nn.Module, cfg_model) -> float:
    """Training FLOPs per token for the MFU: the model's own `flops_per_token()`, the PaLM formula for
    teratrain's decoder, else 6N (N: the global parameter count; attention left out)."""
    own = getattr(model, "flops_per_token", None)
    if own is not None:
        return float(own())
    if is_builtin(model):
        return flops_per_token(cfg_model)
    return 6.0 * sum(math.prod(getattr(p, "placement").global_shape) if hasattr(p, "placement") else p.numel()
                     for p in model.parameters())


class CausalLM(nn.Module):
    """A transformers causal LM (LlamaForCausalLM, GPT2LMHeadModel, ...) under the protocol: forward
    takes (tokens, targets) and returns the mean loss from its logits; its parameters keep their HF
    names under `hf.` and its decoder layers are the blocks."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.hf(input_ids=tokens, use_cache=False).logits  # (B, T, V)
        return logits if targets is None else lm_loss(logits, targets)

    def teratrain_blocks(self) -> list[tuple[str, nn.Module]]:
        return [(f"hf.{name}", block) for name, block in blocks(self.hf)]
