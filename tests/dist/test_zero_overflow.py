"""fp16 with dynamic loss scaling under data parallelism and ZeRO: an inf injected into one element
of one rank's gradients makes every rank skip that step together (parameters bitwise unchanged,
scale halved everywhere), and the next step applies normally."""

import pytest
import torch

from harness import run_ranks
from teratrain.config import load_config
from teratrain.memory.precision import autocast
from teratrain.mesh import init_runtime
from teratrain.models.transformer import Transformer, lm_loss
from teratrain.parallel.parallelize import parallelize
from workers import TINY

POISON_STEP, POISON_RANK = 1, 1


def poisoned_run(rank: int, world: int, zero: int) -> dict:
    cfg = load_config(None, TINY + ["memory.precision=fp16", "memory.loss_scale_init=1024", f"parallel.zero={zero}"])
    rt = init_runtime(cfg)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    engine = parallelize(model, rt, cfg)
    step_box = {"step": -1}

    def poison(grad):  # one element of the embedding output's gradient on one rank only
        if rank == POISON_RANK and step_box["step"] == POISON_STEP:
            grad = grad.clone()
            grad[0, 0, 0] = float("inf")
        return grad

    def attach(module, args, out):
        out.register_hook(poison)  # returns None: a forward hook's return value would replace the output

    model.tok_embeddings.register_forward_hook(attach)
    g = torch.Generator().manual_seed(0)
    history = []
    for step in range(3):
        step_box["step"] = step
        x = torch.randint(0, cfg.model.vocab_size, (world, 2, cfg.model.seq_len + 1), generator=g)[rank]
        with autocast("fp16", rt.device):
            loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        engine.backward(loss)
        stats = engine.step(1e-3)
        history.append({"skipped": stats.skipped, "scale": stats.loss_scale, "params": engine.full_params()})
    return {"history": history, "skipped_total": engine.skipped_steps}


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_inf_on_one_rank_skips_on_every_rank(zero):
    results = run_ranks(poisoned_run, 2, zero)
    for rank, r in enumerate(results):
        h = r["history"]
        assert [s["skipped"] for s in h] == [False, True, False], f"rank {rank}: {[s['skipped'] for s in h]}"
        assert r["skipped_total"] == 1
        assert h[1]["scale"] == h[0]["scale"] / 2
        for name, before in h[0]["params"].items():
            assert torch.equal(h[1]["params"][name], before), f"rank {rank}: {name} changed on a skipped step"
        assert any(not torch.equal(h[2]["params"][n], h[1]["params"][n]) for n in h[1]["params"])
    # every rank holds the same parameters afterwards
    for name, value in results[0]["history"][2]["params"].items():
        assert torch.equal(value, results[1]["history"][2]["params"][name])
