"""Unit tests compute on tiny tensors: one intra-op thread is as fast, and keeps them fast when other
processes busy the CPU (OpenMP workers spin-waiting for a core stretched this tier 3x). No result here
depends on the thread count."""

import torch

torch.set_num_threads(1)
