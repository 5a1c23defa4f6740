"""teratrain: train really large transformers on many GPUs.

The Python API (imported on first use, so `import teratrain` stays light):

    cfg = teratrain.load_config("my.toml", ["parallel.zero=3"])   # typed config, --set style overrides
    summary = teratrain.run(cfg, out="runs/a", model_fn=MyDecoder)  # the trainer: data, loop, checkpoints

or the pieces of the loop, for a loop of your own (under torchrun for several processes):

    rt = teratrain.init_runtime(cfg)                  # process group, named device mesh
    engine = teratrain.parallelize(model, rt, cfg)    # every configured strategy, in one fixed order
    stats, loss = teratrain.train_step(model, engine, micro_batches, cfg.memory.precision, lr)

`model` is teratrain's decoder (`teratrain.Transformer(cfg.model)` on the meta device) or one of your
own that follows the model protocol (teratrain/models/protocol.py; `teratrain.CausalLM` adapts a
transformers causal LM). See docs/checkpoints.md, "Your own model", and examples/own_model.py.
"""

__version__ = "0.1.0"

_API = {
    "Config": "teratrain.config", "load_config": "teratrain.config", "ConfigError": "teratrain.config",
    "init_runtime": "teratrain.mesh", "Runtime": "teratrain.mesh",
    "parallelize": "teratrain.parallel.parallelize", "train_step": "teratrain.optim.engine",
    "run": "teratrain.train", "Transformer": "teratrain.models.transformer",
    "CausalLM": "teratrain.models.protocol", "blocks": "teratrain.models.protocol",
    "save_training": "teratrain.checkpoint.training", "restore_training": "teratrain.checkpoint.training",
}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'teratrain' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_API[name]), name)
