"""teratrain: train really large transformers on many GPUs."""

__version__ = "0.1.0"
