"""`teratrain plan` through teratrain.cli.main: the --json schema, inputs (preset, TOML, --params, HF
config.json), fixed degrees, the plot, and one-sentence exit-2 errors."""

import json
import re

import pytest

from teratrain.cli import main

GIB = 2**30
KEYS = {"params", "grads", "optimizer", "activations", "buffers", "total", "num_params", "step_time_s", "mfu",
        "layout", "host", "candidates", "allowance", "peak_allocated", "phase", "tokens_per_s"}
LAYOUT_KEYS = {"dp", "tp", "pp", "ep", "zero", "micro_batch", "recompute", "offload", "num_microbatches"}


def plan(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def plan_json(capsys, *argv) -> dict:
    rc, out, err = plan(capsys, *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


def test_the_docs_memory_table_is_the_commands_output(capsys):
    """docs/planner.md "Reading the output" shows this command's memory table as it prints it today."""
    from pathlib import Path

    rc, out, _ = plan(capsys, "--model", "llama-8b", "--gpus", "8", "--set", "parallel.tp=2", "--set", "parallel.dp=4",
                      "--set", "parallel.zero=1")
    docs = (Path(__file__).resolve().parents[2] / "docs" / "planner.md").read_text()
    shown = docs.split("## Reading the output", 1)[1].split("```")[1].strip().splitlines()
    printed = out[out.index("Memory per GPU"):].splitlines()[:len(shown)]
    assert rc == 0 and printed == shown


def test_json_schema_and_fit(capsys):
    d = plan_json(capsys, "--model", "gpt2-124m", "--gpus", "2", "--gpu-mem", "40")
    assert KEYS <= d.keys() and LAYOUT_KEYS <= d["layout"].keys()
    assert d["total"] <= 40 * GIB and d["num_params"] > 1.2e8
    assert d["layout"]["dp"] * d["layout"]["tp"] * d["layout"]["pp"] * d["layout"]["ep"] == 2
    assert 0 < d["mfu"] < 1 and d["step_time_s"] > 0
    assert sum(d["at_peak"].values()) == d["peak_allocated"]
    assert d["candidates"][0]["layout"] == d["layout"]


def test_text_table_explains_each_line(capsys):
    rc, out, _ = plan(capsys, "--model", "gpt2-124m", "--gpus", "2")
    assert rc == 0
    for line in ("Chosen layout", "parameters", "gradients", "optimizer state", "activations",
                 "temporary buffers", "allowance", "compute", "step time", "MFU", "Top"):
        assert line in out


def test_degrees_set_by_the_user_are_kept(capsys, tmp_path):
    d = plan_json(capsys, "--model", "gpt2-124m", "--gpus", "4", "--set", "parallel.zero=2",
                  "--set", "memory.recompute=full")
    assert d["layout"]["zero"] == 2 and d["layout"]["recompute"] == "full"
    toml = tmp_path / "run.toml"
    toml.write_text('[model]\npreset = "gpt2-124m"\n[parallel]\ntp = 2\n[train]\nmicro_batch = 4\n')
    d = plan_json(capsys, str(toml), "--gpus", "4")
    assert d["layout"]["tp"] == 2 and d["layout"]["micro_batch"] == 4


def test_bare_parameter_count_plans_model_states_only(capsys):
    d = plan_json(capsys, "--params", "1.5e9")
    assert d["num_params"] == 1_500_000_000 and d["activations"] == 0
    assert d["params"] + d["grads"] + d["optimizer"] == 24 * 10**9  # 16 bytes/param (ZeRO sec. 3.1)
    assert d["step_time_s"] is None


def test_hf_config_json_llama_gpt2_and_mixtral(capsys, tmp_path):
    llama = {"model_type": "llama", "hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
             "num_key_value_heads": 2, "intermediate_size": 1536, "vocab_size": 32000,
             "max_position_embeddings": 131072, "tie_word_embeddings": False}
    mixtral = {**llama, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2}
    gpt2 = {"model_type": "gpt2", "n_embd": 256, "n_layer": 2, "n_head": 4, "vocab_size": 1000, "n_positions": 256}
    sizes = {}
    for name, hf in (("llama", llama), ("mixtral", mixtral), ("gpt2", gpt2)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(hf))
        d = plan_json(capsys, str(path), "--set", "model.seq_len=512")
        sizes[name] = d["num_params"]
        assert d["seq_len"] == (512 if name != "gpt2" else 512)
    mlp = 3 * 512 * 1536
    assert sizes["mixtral"] - sizes["llama"] == 4 * (7 * mlp + 512 * 8)  # 7 more experts + a router per layer
    d = plan_json(capsys, str(tmp_path / "llama.json"))
    assert d["seq_len"] == 8192 and any("seq_len" in n for n in d["notes"])  # long contexts are capped, said


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "olmoe", "qwen3_moe_wide_heads"])
def test_hf_config_json_of_qwen_and_olmoe_counts_transformers_parameters(capsys, tmp_path, family):
    """q/k/v biases, q/k norms, experts narrower than the dense MLP, a gated shared expert, a dense
    first layer and heads wider than hidden_size / heads (head_dim 12, not 8): the plan of config.json
    counts exactly the parameters of transformers' model."""
    pytest.importorskip("transformers")
    from tests.hf_models import save_moe, save_qwen2, save_qwen3

    save = {"qwen2": save_qwen2, "qwen3": save_qwen3,
            "qwen3_moe_wide_heads": lambda path: save_moe(path, "qwen3_moe", head_dim=12)}.get(
        family, lambda path: save_moe(path, family))
    hf = save(tmp_path)
    d = plan_json(capsys, str(tmp_path / "config.json"), "--set", "model.seq_len=64")
    assert d["num_params"] == sum(p.numel() for p in hf.parameters())


def test_plot_writes_a_png(capsys, tmp_path):
    png = tmp_path / "mem.png"
    rc, out, _ = plan(capsys, "--model", "gpt2-124m", "--plot", str(png))
    assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_batch_advice(capsys):
    d = plan_json(capsys, "--model", "gpt2-124m", "--set", "optim.base_batch=8", "--set", "train.global_batch=32")
    adv = d["batch_advice"]
    assert adv["rule"] == "sqrt" and adv["lr"] == pytest.approx(2 * adv["base_lr"]) and not adv["applied"]
    # a config that scales the LR itself is told to keep it as tuned, not to scale it a second time
    rc, out, _ = plan(capsys, "--model", "gpt2-124m", "--set", "optim.base_batch=8", "--set", "train.global_batch=32",
                      "--set", "optim.lr_scaling=sqrt")
    assert rc == 0 and "keep optim.lr as tuned" in out and "use lr=" not in out


@pytest.mark.parametrize("argv, words", [
    (["--model", "gpt3"], "model.preset"),
    (["--model", "gpt2-124m", "--gpus", "0"], "--gpus"),
    (["--model", "gpt2-124m", "--hw", "warp_speed=9"], "--hw"),
    (["--model", "gpt2-124m", "--gpus", "8", "--set", "parallel.tp=3"], "does not divide --gpus 8"),
    (["--model", "gpt2-1.5b", "--gpus", "8", "--set", "parallel.tp=2"], "model.n_heads (25)"),
    (["--model", "llama-70b", "--gpus", "1", "--gpu-mem", "80"], "--gpus"),
    (["--params", "-5"], "--params"),
    (["--model", "gpt2-124m", "--set", "parallel.pp=4", "--set", "parallel.schedule=interleaved-1f1b", "--set",
      "parallel.virtual_stages=2", "--set", "train.global_batch=12", "--set", "train.micro_batch=2"],
     "multiple of parallel.pp=4"),
    (["--model", "gpt2-124m", "--set", "parallel.pp=2", "--set", "parallel.virtual_stages=2"],
     "needs parallel.schedule=interleaved-1f1b"),
    (["--model", "tiny", "--gpus", "2", "--set", "parallel.ep=2"], "needs a mixture-of-experts model"),
    (["--model", "tiny", "--plot", "/nonexistent/m.png"], "does not exist or is not writable"),
    (["--model", "tiny", "--plot", "m.txt"], "does not end in .png, .svg or .pdf"),
    (["--model", "tiny", "--gpus", "2", "--set", "parallel.pp=2", "--schedule-plot", "/nonexistent/s.png"],
     "--schedule-plot /nonexistent/s.png"),
])
def test_bad_input_exits_2_with_one_sentence(capsys, argv, words):
    rc, out, err = plan(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.startswith("teratrain: error: ") and err.count("\n") == 1 and words in err
    assert "Traceback" not in err


def test_schedule_plot_draws_the_simulated_pipeline(capsys, tmp_path):
    png = tmp_path / "pipe.png"
    rc, out, _ = plan(capsys, "--model", "llama-1b", "--gpus", "4", "--set", "parallel.pp=4", "--set",
                      "parallel.schedule=interleaved-1f1b", "--set", "parallel.virtual_stages=2",
                      "--set", "train.global_batch=8", "--schedule-plot", str(png))
    assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "schedule=interleaved-1f1b v=2" in out and f"pipeline timeline written to {png}" in out
    rc, out, err = plan(capsys, "--params", "1e9", "--schedule-plot", str(png))
    assert rc == 2 and "--schedule-plot needs a model shape" in err
    # a split whose first stage holds the embedding alone: drawn and reported as split, idle near half the step
    rc, out, _ = plan(capsys, "--model", "llama-1b", "--gpus", "2", "--set", "parallel.pp=2", "--set",
                      "parallel.stage_layers=[0,16]", "--set", "train.global_batch=8", "--schedule-plot", str(png))
    reported = float(re.search(r"([\d.]+)% of the pipelined time idle", out).group(1))
    drawn = float(re.search(r"simulated bubble ([\d.]+)%", out).group(1))
    assert rc == 0 and "(the stages of its split, the head on the last)" in out
    assert 45 < reported < 55 and drawn == pytest.approx(reported, abs=1.0)


def test_host_paced_layouts_are_said(capsys):
    """A layout whose host takes longer to issue the step than its GPU to run it (tensor parallelism
    splits every matmul, not the host's work) gets a 'host issue' line that says so and a note on what
    that means for its speed; a data-parallel layout of the same model hides its host time."""
    model = ["--model", "llama-1b", "--gpus", "2", "--set", "model.seq_len=2048", "--set", "train.global_batch=4",
             "--set", "train.micro_batch=2"]
    rc, out, _ = plan(capsys, *model, "--set", "parallel.tp=2", "--set", "parallel.dp=1")
    assert rc == 0 and "host-paced" in next(line for line in out.splitlines() if "host issue" in line)
    assert "Note: the chosen layout's step is host-paced" in out
    d = plan_json(capsys, *model, "--set", "parallel.dp=2", "--set", "parallel.tp=1")
    assert 0 < d["time"]["terms"]["host_s"] < d["time"]["terms"]["gpu_s"]
    assert not any("host-paced" in n for n in d["notes"])


def test_a_host_paced_zb_h1_layout_is_told_1f1b_runs_it_faster(capsys):
    """ZB-H1's split backward costs the host 74 ops a block and micro-batch (planner/time.py split_ops):
    where the host paces the step (tp splits every matmul) the same layout under 1F1B plans faster, and
    the plan says so; where the GPU paces it (pp alone) ZB-H1's smaller bubble wins and nothing is said."""
    model = ["--model", "llama-1b", "--gpus", "4", "--set", "model.n_layers=32", "--set", "model.seq_len=2048",
             "--set", "train.global_batch=16", "--set", "train.micro_batch=2", "--set", "parallel.schedule=zb-h1"]
    d = plan_json(capsys, *model, "--set", "parallel.pp=2", "--set", "parallel.tp=2")
    (note,) = [n for n in d["notes"] if n.startswith("ZB-H1 plans")]
    assert "slower than 1F1B" in note and "parallel.schedule=1f1b" in note
    d = plan_json(capsys, *model, "--set", "parallel.pp=4", "--set", "parallel.tp=1")
    assert d["time"]["terms"]["host_s"] < d["time"]["terms"]["gpu_s"]
    assert not any(n.startswith("ZB-H1 plans") for n in d["notes"])


def test_compiled_runs_say_how_they_are_planned_and_refused_layouts_left_out(capsys):
    """train.compile: the plan says how its time is planned; with ZeRO-3 it leaves out the
    recompute policies the trainer refuses there (config.compile_scope_problem), so no candidate's
    command fails at launch."""
    d = plan_json(capsys, "--model", "llama-1b", "--gpus", "2", "--set", "train.compile=true", "--set",
                  "parallel.zero=3", "--set", "train.global_batch=8", "--top", "40")
    assert any(n.startswith("train.compile is planned with inductor's fused kernels") for n in d["notes"])
    recomputes = {c["layout"]["recompute"] for c in d["candidates"]}
    assert recomputes and not recomputes & {"full", "every-k", "sqrt"}, recomputes
    eager = plan_json(capsys, "--model", "llama-1b", "--gpus", "2", "--set", "parallel.zero=3", "--set",
                      "train.global_batch=8", "--top", "40")
    assert {c["layout"]["recompute"] for c in eager["candidates"]} & {"full", "sqrt"}
    assert not any(n.startswith("train.compile") for n in eager["notes"])


def test_graphed_expert_parallelism_is_pointed_at_the_reordered_exchange(capsys):
    """A graphed MoE plan at ep > 2 without train.compile_overlap gets the note on hiding the exchange
    (measured at ep=4, nothing at ep=2); with the setting, or at ep=2, it does not."""
    graphed = ["--model", "llama-1b", "--gpus", "4", "--set", "model.moe.num_experts=8", "--set", "model.moe.top_k=2",
               "--set", "train.global_batch=8", "--set", "train.compile=true",
               "--set", "train.compile_mode=reduce-overhead", "--set", "memory.precision=bf16"]
    said = lambda d: any(n.startswith("expert parallelism over more than 2 GPUs") for n in d["notes"])  # noqa: E731
    assert said(plan_json(capsys, *graphed, "--set", "parallel.ep=4", "--set", "parallel.dp=4"))
    assert not said(plan_json(capsys, *graphed, "--set", "parallel.ep=4", "--set", "parallel.dp=4",
                              "--set", "train.compile_overlap=true"))
    assert not said(plan_json(capsys, *graphed, "--set", "parallel.ep=2", "--set", "parallel.dp=4"))


def test_constants_another_card_measured_are_named(capsys):
    """A preset's constants that hold another card's values (calibration/<card>.toml) are named where the plan
    reads them; one given with --hw is the user's. The H200 holds one: the host's cost of a tensor the AdamW
    kernel was launched on, measured on an H100's host, which only runs recorded so are planned with."""
    from teratrain.planner.hardware import borrowed

    assert borrowed("h200") == ["host_optimizer_tensor_s"] and "mem_efficiency" in borrowed("a100")
    note = next(n for n in plan_json(capsys, "--model", "gpt2-124m", "--gpus", "2", "--gpu", "a100")["notes"]
                if "another card's value" in n)
    assert "mem_efficiency" in note and "fp8_speedup" not in note and "moe_efficiency" not in note  # dense, bf16
    notes = plan_json(capsys, "--model", "gpt2-124m", "--gpus", "2", "--gpu", "a100", "--hw", "mem_efficiency=0.6",
                      "--hw", "host_op_s=1e-5")["notes"]
    assert not any("mem_efficiency" in n or "host_op_s" in n for n in notes if "another card's value" in n)
    h200 = plan_json(capsys, "--model", "gpt2-124m", "--gpu", "h200")["notes"]
    assert not any("another card's value" in n for n in h200)  # a launch a group: the constant is not read


def test_pipelined_layouts_show_their_schedule_in_the_config_spelling(capsys):
    """The ranking tells apart layouts that differ only in schedule or virtual stages; --json spells the
    schedule as parallel.schedule takes it."""
    sets = ["--model", "gpt2-124m", "--gpus", "2", "--set", "parallel.pp=2", "--set", "train.global_batch=8"]
    d = plan_json(capsys, *sets)
    from teratrain.parallel.pipeline.schedules import CONFIG_NAMES

    assert {c["layout"]["schedule"] for c in d["candidates"]} <= set(CONFIG_NAMES)
    rc, out, _ = plan(capsys, *sets)
    ranking = out[out.index("Top "):].splitlines()
    assert rc == 0 and "schedule" in ranking[1] and d["layout"]["schedule"] in ranking[2]


def test_long_splits_print_as_runs():
    from teratrain.planner.report import split_str

    assert split_str((7,) + (8,) * 14 + (7,)) == "7/8x14/7" and split_str((0,) + (1,) * 126 + (0,)) == "0/1x126/0"
    assert split_str((2, 2, 1)) == "2/2/1" and split_str((3, 2)) == "3/2"


def test_a_shape_changed_by_set_is_named_as_changed(capsys):
    """The plan names a preset whose shape --set changed as changed, not by the preset's name alone (a shape
    given key by key over the default preset would otherwise read as `tiny`)."""
    assert plan_json(capsys, "--model", "gpt2-124m", "--gpus", "1")["model"] == "gpt2-124m"
    assert plan_json(capsys, "--model", "gpt2-124m", "--gpus", "1", "--set", "model.n_layers=4")["model"] == \
        "gpt2-124m preset with n_layers changed"
    rc, _, err = plan(capsys, "--gpus", "1", "--gpu-mem", "1", "--set", "model.d_model=2048",
                      "--set", "model.n_heads=16", "--set", "model.n_layers=24")
    assert rc != 0 and "no layout of tiny preset with n_layers, d_model, n_heads changed fits 1 GiB" in err
    moe = plan_json(capsys, "--model", "moe-tiny", "--gpus", "1", "--set", "model.moe.num_experts=16")
    assert moe["model"] == "moe-tiny preset with moe.num_experts changed"
