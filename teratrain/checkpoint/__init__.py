"""Checkpoints: atomic directories of safetensors + JSON, a `latest` pointer, fallback on corruption."""

from teratrain.checkpoint.format import CheckpointError
from teratrain.checkpoint.io import find_valid, load_rank, save

__all__ = ["CheckpointError", "find_valid", "load_rank", "save"]
