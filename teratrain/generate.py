"""`teratrain generate`: load a trained run's weights and tokenizer, sample a continuation."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer

from teratrain.checkpoint import CheckpointError, find_valid
from teratrain.checkpoint.consolidate import load_weights
from teratrain.config import load_config
from teratrain.data.tokenizer import EOT
from teratrain.models.sampling import sample
from teratrain.models.transformer import build_model


def generate(run: str, prompt: str, max_new_tokens: int, temperature: float, top_k: int, seed: int) -> str:
    run_dir, ckpt_dir = _locate(Path(run))
    cfg = load_config(run_dir / "config.toml")
    tok_path = run_dir / "tokenizer.json"
    if not tok_path.exists():
        raise CheckpointError(f"{run_dir} has no tokenizer.json (trained on a pre-tokenized .bin); copy the "
                              "tokenizer.json used to make it into the run folder.")
    tokenizer = Tokenizer.from_file(str(tok_path))
    if ckpt_dir is None:
        ckpt_dir, _ = find_valid(run_dir / "checkpoints")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(cfg.model, device)
    load_weights(model, ckpt_dir)  # tensor by tensor from the logical checkpoint: no optimizer state read
    ids = tokenizer.encode(prompt).ids if prompt else [tokenizer.token_to_id(EOT) or 0]
    out = sample(model, ids, max_new_tokens, temperature, top_k or None, seed, stop_token=tokenizer.token_to_id(EOT))
    return tokenizer.decode(out)


def _locate(path: Path) -> tuple[Path, Path | None]:
    """A run folder, or one checkpoint folder inside it."""
    if not path.exists():
        raise CheckpointError(f"--ckpt '{path}' does not exist; give a run directory such as runs/20260101-120000.")
    if (path / "meta.json").exists():
        return path.parent.parent, path
    if not (path / "config.toml").exists():
        raise CheckpointError(f"--ckpt '{path}' is not a teratrain run (no config.toml); give the run directory.")
    return path, None
