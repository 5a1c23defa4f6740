"""Fine-tuning from a Hugging Face folder at any layout: every rank reads only its pieces of the HF
weights (tensor-parallel slices, ZeRO-3 shards, its experts), and 10 AdamW steps equal one process
started from the same folder within 1e-5 relative (fp32; the TP parity tolerance, test_tensor_parallel.py)."""

from pathlib import Path

import pytest
import torch

from harness import run_ranks
from layout_workers import GPT2, batches, build, train_random, train_steps
from teratrain.checkpoint.hf_export import export
from teratrain.checkpoint.training import save_training
from teratrain.config import load_config
from teratrain.config_toml import to_toml
from teratrain.fsio import atomic_write_bytes
from tests.hf_models import save_gpt2, save_llama, save_mixtral, save_moe, save_qwen2, save_qwen3

pytest.importorskip("transformers")
TOL = 1e-5


def _many(rank: int, world: int, layouts: list[list[str]]) -> list[dict]:
    return [train_random(rank, world, layout) for layout in layouts]


def max_rel_diff(a: dict, b: dict, floor: float = 1e-3) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).norm() / max(float(b[k].double().norm()), floor)) for k in a)


@pytest.mark.long
def test_llama_mixtral_and_gpt2_from_hf_at_every_layout(tmp_path):
    """Mixtral at ep=2 x tp=2: each rank reads its two experts' column / row slices. Qwen2's q/k/v
    biases split with their heads (tp=2, sequence parallel; SGD, as GPT-2: a key bias has no true
    gradient, test_tensor_parallel.py, so AdamW would scale its rounding to lr-sized steps). Qwen3's
    per-head q/k norms whole on every rank, their gradients summed over tp (tp=4: each key head on 2
    ranks; SGD at lr 0.5, where every tensor agrees within 4e-6, so a miscounted norm gradient would
    show: under AdamW, eps 1e-6, the rounding of the split sums grows to 1.3e-5 on every matrix).
    OLMoE at ep=2 x tp=2 in both per-layer forms (its whole-width q/k norms rule out the megatron form),
    SGD: one step's gradients equal one process's within 2e-6 on every tensor, but AdamW (eps 1e-6)
    divides gradient entries near zero (5e-7, sums of 1e-3 terms off by 3e-9 of rounding) by their own
    size: after 10 steps the all-reduce form's parameters are 9e-5 apart (4e-6 at eps 1e-4)."""
    save_llama(tmp_path / "llama")
    save_mixtral(tmp_path / "mixtral")
    save_gpt2(tmp_path / "gpt2", n_inner=64)  # the MLP width of BASE
    save_qwen2(tmp_path / "qwen2")
    save_qwen3(tmp_path / "qwen3")
    save_moe(tmp_path / "olmoe", "olmoe")
    llama, mixtral, qwen2, qwen3 = ([f"model.init_from={str(tmp_path / name)!r}"]
                                    for name in ("llama", "mixtral", "qwen2", "qwen3"))
    gpt2 = GPT2 + [f"model.init_from={str(tmp_path / 'gpt2')!r}", "optim.name=sgd", "optim.lr=0.05"]
    layouts = [llama + ["parallel.tp=2", "parallel.zero=3"], llama + ["parallel.zero=3"], llama + ["parallel.tp=4"],
               gpt2 + ["parallel.tp=2", "parallel.zero=1"], gpt2 + ["parallel.zero=3", "parallel.offload=params"],
               mixtral + ["parallel.ep=2", "parallel.tp=2"],
               qwen2 + ["optim.name=sgd", "optim.lr=0.05", "parallel.tp=2", "parallel.sequence_parallel=true"],
               qwen3 + ["optim.name=sgd", "optim.lr=0.5", "parallel.tp=4"]]
    olmoe = [f"model.init_from={str(tmp_path / 'olmoe')!r}", "optim.name=sgd", "optim.lr=0.05", "parallel.ep=2",
             "parallel.tp=2"]
    layouts += [olmoe + ["parallel.tp_form=all-reduce"], olmoe + ["parallel.tp_form=all-gather"]]
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


SGD = ["optim.name=sgd", "optim.lr=0.5", "optim.momentum=0", "optim.weight_decay=0", "optim.schedule=constant",
       "train.grad_clip=0"]


MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "olmoe")


def _train_and_save(rank: int, world: int, root: Path) -> None:
    """For each family: 3 steps of `batches` on this rank's share from root/<family>/src, then the
    run's checkpoint and config.toml in root/<family>/run."""
    for family in MOE_FAMILIES:
        cfg, rt, model, engine = build([f"model.init_from={str(root / family / 'src')!r}", "parallel.ep=2"] + SGD)
        train_steps(cfg, rt, model, engine, 3)
        run_dir = root / family / "run"
        if rt.is_main:
            run_dir.mkdir()
            atomic_write_bytes(run_dir / "config.toml", to_toml(cfg).encode())
        save_training(run_dir / "checkpoints", 3, cfg, rt, engine)


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory) -> Path:
    """The three families saved and trained at ep=2 in one launch of 2 processes (one start-up)."""
    root = tmp_path_factory.mktemp("moe")
    for family in MOE_FAMILIES:
        save_moe(root / family / "src", family)
    run_ranks(_train_and_save, 2, root)
    return root


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_family_from_hf_trained_at_ep2_exports_what_transformers_trains(moe_runs, family):
    """model.init_from of a Qwen2-MoE, Qwen3-MoE or OLMoE folder, 3 SGD steps at ep=2 on 2 processes
    (each reads its 2 of the 4 experts), `teratrain export`; transformers' own model, trained by
    plain PyTorch on the same global batches (mean cross-entropy, no aux loss: output_router_logits
    is false), and the exported folder loaded by transformers give the same logits within 1e-5
    relative (fp32)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(moe_runs / family / "src").train()
    export(moe_runs / family / "run", moe_runs / family / "out")
    cfg = load_config(moe_runs / family / "run" / "config.toml")
    tokens = torch.randint(0, 50, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = hf(tokens).logits
    opt = torch.optim.SGD(hf.parameters(), lr=cfg.optim.lr)
    for batch in batches(cfg, 3):
        logits = hf(batch[:, :-1]).logits  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    exported = transformers.AutoModelForCausalLM.from_pretrained(moe_runs / family / "out").eval()
    assert type(exported).__name__ == type(hf).__name__
    with torch.no_grad():
        want, got = hf.eval()(tokens).logits, exported(tokens).logits
    err = float((got - want).norm() / want.norm())
    assert err < TOL, f"{family}: logits differ by {err:.2e} (relative)"
    assert float((want - before).norm() / before.norm()) > 1e-3  # the steps moved the model
