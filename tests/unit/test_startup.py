"""The start-up checks: model states beyond free memory are refused before anything is built; the
summary warns instead of failing (a layout that will not fit, a planner that cannot model the run)."""

from pathlib import Path

import pytest
import torch

from teratrain import startup
from teratrain.config import ConfigError
from teratrain.mesh import Mesh, ParallelDims, Runtime
from tests.helpers import make_config


def test_model_states_beyond_free_memory_are_refused():
    with pytest.raises(ConfigError, match=r"this 70\.\d\d B-parameter model needs .* host memory.*parallel.zero=3"):
        startup.check_host_memory(make_config("model.preset=llama-70b"), 1, 1, on_cpu=True)  # ~1 TiB of fp32 states
    with pytest.raises(ConfigError, match=r"or shard it over more GPUs \(") as e:  # ZeRO-3 already: not advised again
        startup.check_host_memory(make_config("model.preset=llama-70b", "parallel.zero=3"), 1, 1, on_cpu=True)
    assert "zero=3" not in str(e.value)
    startup.check_host_memory(make_config("model.preset=llama-70b"), 1, 1, on_cpu=False)  # they live on GPUs
    startup.check_host_memory(make_config(), 1, 1, on_cpu=True)


def test_a_cpu_step_whose_activations_exceed_free_memory_is_refused(monkeypatch):
    """The tiny model's states are small, but 100,000-token sequences' activations are not: on a CPU the
    predicted peak is checked too (the OOM killer would end it without a word), on a GPU only the states."""
    long = make_config("model.seq_len=100000", "train.micro_batch=1", "train.global_batch=1")
    monkeypatch.setattr(startup, "host_available_bytes", lambda: 8 * 2**30)
    with pytest.raises(ConfigError, match="train.micro_batch or model.seq_len"):
        startup.check_host_memory(long, 1, 1, on_cpu=True)
    startup.check_host_memory(long, 1, 1, on_cpu=False)
    startup.check_host_memory(make_config(), 1, 1, on_cpu=True)


def test_summary_warns_when_the_prediction_exceeds_free_memory(monkeypatch):
    monkeypatch.setattr(startup, "host_available_bytes", lambda: 1024)
    text = startup.summary(make_config(), Runtime.single("cpu"), Path("runs/x"), 0)
    assert "teratrain: warning: predicted memory per process" in text and "free on this machine" in text


def test_a_planner_failure_is_a_warning_not_a_stop(monkeypatch):
    def broken(*_a, **_k):
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr(startup, "plan_run", broken)
    text = startup.summary(make_config(), Runtime.single("cpu"), Path("runs/x"), 0)
    assert "warning: the planner could not predict memory" in text and "ZeroDivisionError" in text
    startup.check_host_memory(make_config("model.preset=llama-70b"), 1, 1, on_cpu=True)  # no plan, no refusal


def test_summary_names_every_degree_and_the_model_started_from():
    """A tp=2 run reads tp=2 (not `dp=1 zero=0` alone), a pipeline names its schedule, and a run
    started from a Hugging Face folder is called by that folder, not by the default preset."""
    cfg = make_config("parallel.tp=2", "parallel.pp=2", "parallel.schedule=zb-h1", "train.global_batch=64")
    dims = ParallelDims(dp=1, tp=2, pp=2)
    rt = Runtime(rank=0, world=4, local_rank=0, device=torch.device("cpu"), dims=dims, mesh=Mesh(dims, 0))
    text = startup.summary(cfg, rt, Path("runs/x"), 0)
    assert "layout: dp=1 tp=2 pp=2 (zb-h1) ep=1 zero=0" in text
    hf = cfg.model_copy(update={"model": cfg.model.model_copy(update={"init_from": "~/models/Llama-3.2-1B"})})
    text = startup.summary(hf, rt, Path("x"), 0)
    assert "teratrain: model: Llama-3.2-1B from model.init_from (llama, 4 layers" in text


def test_summary_names_the_experts_and_the_family_of_a_mixtral_start(tmp_path):
    """An MoE model says its experts (a preset's too); a Mixtral started from is called mixtral, and
    the aux loss it trains with is said with where it came from."""
    pytest.importorskip("transformers")
    from tests.hf_models import save_mixtral

    text = startup.summary(make_config("model.preset=moe-tiny"), Runtime.single("cpu"), Path("runs/x"), 0)
    assert "(llama, 4 layers, d_model 128, 8 experts x top-2)" in text
    deepseek = ["model.moe.expert_d_ff=64", "model.moe.shared_experts=2", "model.moe.score=sigmoid",
                "model.moe.balance=bias", "model.moe.first_dense_layers=1", "model.moe.expert_groups=4",
                "model.moe.max_groups=2"]
    text = startup.summary(make_config("model.preset=moe-tiny", *deepseek), Runtime.single("cpu"), Path("runs/x"), 0)
    assert ("8 experts x top-2, width 64, first 1 dense, 2 shared experts of width 64, sigmoid scores, "
            "experts of the best 2 of 4 groups, bias balance (rate 0.001))") in text
    save_mixtral(tmp_path)
    text = startup.summary(make_config(f"model.init_from={str(tmp_path)!r}", "model.seq_len=16"),
                           Runtime.single("cpu"), Path("runs/x"), 0)
    assert f"model: {tmp_path.name} from model.init_from (mixtral, 2 layers, d_model 32, 4 experts x top-2)" in text
    assert "teratrain: moe: aux loss 0 from config.json (output_router_logits false" in text
    text = startup.summary(make_config(f"model.init_from={str(tmp_path)!r}", "model.seq_len=16",
                                       "model.moe.aux_loss_weight=0.01"), Runtime.single("cpu"), Path("runs/x"), 0)
    assert "moe: aux loss 0.01 (ours convention) from model.moe, not config.json's (router_aux_loss_coef 0.001" in text


def test_parallel_auto_and_the_memory_line_give_one_figure():
    """On the CPU the summary's memory line is the figure parallel.auto chose by (CPU autocast, no CUDA
    context), and the auto line does not repeat it."""
    from dataclasses import replace

    from teratrain.planner.auto import Target, resolve
    from teratrain.planner.hardware import GPUS
    from teratrain.planner.inputs import layout_of, shape_of, training_of
    from teratrain.planner.search import evaluate

    cfg = make_config("parallel.auto=true", "memory.precision=bf16")
    note = resolve(cfg, 1, Target(None, 64.0, None, 1)).note
    chosen = evaluate(shape_of(cfg), training_of(cfg), layout_of(cfg, 1), replace(GPUS["h100"], context_gib=0.0),
                      device="cpu").memory
    text = startup.summary(cfg, Runtime.single("cpu"), Path("runs/x"), 0, [note])
    assert [ln for ln in text.splitlines() if "GiB" in ln and "planner" in ln] == [
        f"teratrain: predicted memory per process: {(chosen.peak_allocated + chosen.host) / 2**30:,.2f} GiB (planner)"]


@pytest.mark.parametrize("sets, there, warned", [
    ([], 0, True),  # by time: saves until keep=2 stay and a third is written beside them
    (["checkpoint.every=0"], 0, False),  # one save, at the end
    (["checkpoint.every=50"], 0, False),  # two saves of 100 steps: two at once at most
    ([], 2, False),  # two there already: one more at once
    (["checkpoint.keep=4"], 2, True),  # three more at once
])
def test_the_disk_check_counts_the_checkpoints_kept_and_the_one_written_beside_them(tmp_path, monkeypatch, sets,
                                                                                     there, warned):
    for step in range(there):
        (tmp_path / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
    monkeypatch.setattr(startup, "free_bytes", lambda path: 2.5e9)
    cfg = make_config("train.steps=100", *sets)
    assert (startup.check_disk(cfg, tmp_path, 10**9) is not None) == warned
    with pytest.raises(ConfigError) as e:
        startup.check_disk(cfg, tmp_path, 3 * 10**9)
    assert "needs 2.8 GiB" in str(e.value) and "2.3 GiB free" in str(e.value) and "\n" not in str(e.value)
