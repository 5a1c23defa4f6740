"""Models not defined in teratrain, for the protocol tests (module-level so spawned ranks import them):
examples/own_model.py's TinyDecoder (meta device, its own init, a buffer, a tied output layer) and
transformers' Llama and GPT-2 through `teratrain.CausalLM` (built on the CPU: their values are kept)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from layout_workers import train_steps
from teratrain.checkpoint.training import restore_training, save_training
from teratrain.config import load_config
from teratrain.mesh import init_runtime
from teratrain.models.protocol import CausalLM
from teratrain.parallel.parallelize import parallelize
from teratrain.train import seed_everything

BASE = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.vocab_size=50", "model.seq_len=16",
        "train.global_batch=8", "train.micro_batch=2", "optim.lr=0.01", "optim.eps=1e-6", "optim.warmup_steps=0",
        "optim.schedule=constant", "train.device=cpu"]
_example = importlib.util.spec_from_file_location("own_model_example",
                                                  Path(__file__).parents[2] / "examples" / "own_model.py")
example = importlib.util.module_from_spec(_example)
_example.loader.exec_module(example)


def make(kind: str, cfg):
    if kind == "tiny":
        return example.tiny_decoder(cfg)
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        hf = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))
    else:  # GPT-2: its lm_head is tied to wte
        hf = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=16, resid_pdrop=0.0,
                                        embd_pdrop=0.0, attn_pdrop=0.0))
    return CausalLM(hf)


def train_own(rank: int, world: int, kind: str, overrides: list[str], steps: int = 6, save_to: str | None = None,
              resume_from: str | None = None) -> dict:
    cfg = load_config(None, BASE + overrides)
    rt = init_runtime(cfg)
    cfg.parallel.dp = rt.dims.dp
    seed_everything(cfg.train.seed + rt.dp_rank)
    model = make(kind, cfg)
    engine = parallelize(model, rt, cfg)
    start = restore_training(Path(resume_from) / "checkpoints", cfg, rt, engine, Path(resume_from)) if resume_from else 0
    losses = train_steps(cfg, rt, model, engine, steps, start)
    if save_to:
        save_training(Path(save_to) / "checkpoints", steps, cfg, rt, engine)
    params = engine.full_params()
    return {"losses": losses, "params": params if rank == 0 else None}


def many(rank: int, world: int, jobs: list[dict]) -> list[dict]:
    return [train_own(rank, world, **job) for job in jobs]
