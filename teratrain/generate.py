"""`teratrain generate`: load a trained (or quantized) run's weights and tokenizer, sample a continuation."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import nn

from teratrain.checkpoint import CheckpointError, find_valid
from teratrain.checkpoint.io import verify
from teratrain.checkpoint.consolidate import load_weights
from teratrain.config import Config, load_config
from teratrain.data.tokenizer import EOT
from teratrain.memory import lora
from teratrain.memory.quantize import is_quantized, load_quantized
from teratrain.models.sampling import sample
from teratrain.models.transformer import build_model


DEFAULT_NEW_TOKENS = 200  # unless the context holds fewer after the prompt (then silently fewer)


def generate(run: str, prompt: str, max_new_tokens: int | None, temperature: float, top_k: int, seed: int) -> str:
    """A continuation of `prompt`: `max_new_tokens` tokens (said when the context cannot hold them), or,
    unset, DEFAULT_NEW_TOKENS or as many as the context holds after the prompt."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg, run_dir, model = load_model(run, device)
    tok_path = run_dir / "tokenizer.json"
    if not tok_path.exists():
        raise CheckpointError(f"{run_dir} has no tokenizer.json (trained on a pre-tokenized .bin); copy the "
                              "tokenizer.json used to make it into the run folder.")
    try:
        tokenizer = Tokenizer.from_file(str(tok_path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on bad files
        raise CheckpointError(f"{tok_path} is unreadable ({str(e)[:80]}); copy the tokenizer.json the run was "
                              "trained with back into the run folder.") from None
    ids = tokenizer.encode(prompt).ids if prompt else [tokenizer.token_to_id(EOT) or 0]
    room = _warn_context(len(ids), max_new_tokens, cfg.model.seq_len)
    max_new_tokens = max_new_tokens or min(DEFAULT_NEW_TOKENS, room)
    out = sample(model, ids, max_new_tokens, temperature, top_k or None, seed, stop_token=tokenizer.token_to_id(EOT))
    return tokenizer.decode(out)


def load_model(run: str | Path, device: torch.device) -> tuple[Config, Path, nn.Module]:
    """The config, the folder holding the tokenizer, and the model with its weights, of a run folder,
    one of its checkpoint folders, or a `teratrain quantize` output folder."""
    path = Path(run)
    if is_quantized(path):
        cfg, model = load_quantized(path, device)
        return cfg, path, model
    run_dir, ckpt_dir = _locate(path)
    cfg = load_config(run_dir / "config.toml")
    if ckpt_dir is None:
        ckpt_dir, _ = find_valid(run_dir / "checkpoints")
    model = build_model(cfg.model, device)
    load_weights(model, ckpt_dir)  # tensor by tensor from the logical checkpoint: no optimizer state read
    if cfg.lora.rank:  # a LoRA run samples with its adapters folded into the base weights
        lora.merge_from_checkpoint(model, ckpt_dir, cfg.lora.alpha)
    return cfg, run_dir, model


def _warn_context(prompt_tokens: int, max_new_tokens: int | None, context: int) -> int:
    """The model attends to at most model.seq_len positions (it was trained at that length): say what
    of the request fits instead of cutting it silently. Returns the tokens the context holds after
    the prompt."""
    kept = min(prompt_tokens, context - 1)
    if prompt_tokens > kept:
        print(f"teratrain: warning: the prompt is {prompt_tokens} tokens but the model's context (model.seq_len) is "
              f"{context}; only its last {kept} tokens are used.", file=sys.stderr)
    if max_new_tokens is not None and kept + max_new_tokens > context:
        print(f"teratrain: warning: --max-new-tokens {max_new_tokens} does not fit the model's context of {context} "
              f"tokens (model.seq_len) after a {kept}-token prompt; generating at most {context - kept}.",
              file=sys.stderr)
    return context - kept


def _locate(path: Path) -> tuple[Path, Path | None]:
    """A run folder, or one checkpoint folder inside it."""
    if not path.exists():
        raise CheckpointError(f"--ckpt '{path}' does not exist; give a run directory such as runs/20260101-120000.")
    if (path / "meta.json").exists():  # one checkpoint, named: verified as a run's newest would be
        run = path.parent.parent
        if path.name.endswith(".unusable"):
            raise CheckpointError(f"--ckpt '{path}' was set aside as unusable when its run resumed from an older "
                                  f"step; give the run directory {run} to use its newest intact checkpoint.")
        try:
            verify(path, rank=0)
        except CheckpointError as e:
            raise CheckpointError(f"--ckpt '{path}' cannot be used: {e}; give the run directory {run} to use its "
                                  "newest intact checkpoint.") from None
        return run, path
    if not path.is_dir():
        raise CheckpointError(f"--ckpt '{path}' is a file, not a run; give the run directory that holds it.")
    if not (path / "config.toml").exists():
        raise CheckpointError(f"--ckpt '{path}' is not a teratrain run (no config.toml); give the run directory.")
    return path, None
