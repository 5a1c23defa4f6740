"""Fine-tuning from a Hugging Face folder at any layout: every rank reads only its pieces of the HF
weights (tensor-parallel slices, ZeRO-3 shards, its experts), and 10 AdamW steps equal one process
started from the same folder within 1e-5 relative (fp32; the TP parity tolerance, test_tensor_parallel.py)."""

import pytest

from harness import run_ranks
from layout_workers import GPT2, train_random
from tests.hf_models import save_gpt2, save_llama, save_mixtral

pytest.importorskip("transformers")
TOL = 1e-5


def _many(rank: int, world: int, layouts: list[list[str]]) -> list[dict]:
    return [train_random(rank, world, layout) for layout in layouts]


def max_rel_diff(a: dict, b: dict, floor: float = 1e-3) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).norm() / max(float(b[k].double().norm()), floor)) for k in a)


def test_llama_mixtral_and_gpt2_from_hf_at_every_layout(tmp_path):
    """Mixtral at ep=2 x tp=2: each rank reads its two experts' column / row slices."""
    save_llama(tmp_path / "llama")
    save_mixtral(tmp_path / "mixtral")
    save_gpt2(tmp_path / "gpt2", n_inner=64)  # the MLP width of BASE
    llama = [f"model.init_from={str(tmp_path / 'llama')!r}"]
    mixtral = [f"model.init_from={str(tmp_path / 'mixtral')!r}"]
    gpt2 = GPT2 + [f"model.init_from={str(tmp_path / 'gpt2')!r}", "optim.name=sgd", "optim.lr=0.05"]
    layouts = [llama + ["parallel.tp=2", "parallel.zero=3"], llama + ["parallel.zero=3"], llama + ["parallel.tp=4"],
               gpt2 + ["parallel.tp=2", "parallel.zero=1"], gpt2 + ["parallel.zero=3", "parallel.offload=params"],
               mixtral + ["parallel.ep=2", "parallel.tp=2"]]
    got = run_ranks(_many, 4, layouts)[0]
    refs = {}
    for layout, run in zip(layouts, got):
        base = tuple(o for o in layout if not o.startswith("parallel."))
        ref = refs.setdefault(base, train_random(0, 1, list(base)))
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], ref["losses"]))
        assert loss_err < TOL, f"{layout}: losses differ by {loss_err:.2e}"
        assert max_rel_diff(run["params"], ref["params"]) < TOL, layout
    scratch = train_random(0, 1, [])  # the same shape from a random init: the HF weights were used
    assert abs(refs[tuple(llama)]["losses"][0] - scratch["losses"][0]) > 1e-3
