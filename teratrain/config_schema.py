"""The run configuration's schema: every section, its fields (each with its unit) and the checks
that span fields.

Checks that span fields live here only where the field belongs to no other component; errors are
raised as `ConfigError` with one sentence that names the key and the fix (the CLI prints it and
exits 2, no traceback). Nothing here reads a file: reading TOML, --set overrides and what
`model.init_from` fills in are the loader's (config.py), which imports this module, never the reverse.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from teratrain.config_base import ConfigError, Section
from teratrain.config_model import ModelConfig


class TrainConfig(Section):
    steps: int = Field(300, ge=1, description="optimizer steps")
    global_batch: int = Field(32, ge=1, description="sequences per optimizer step, over all data-parallel ranks")
    micro_batch: int = Field(16, ge=1, description="sequences per forward/backward on one rank")
    seed: int = Field(1234, ge=0, description="seed of init, dropout and data order")
    log_every: int = Field(10, ge=1, description="steps between progress-bar/log updates")
    eval_every: int = Field(100, ge=0, description="steps between held-out evaluations (0 = only at the end)")
    eval_batches: int = Field(4, ge=0, description="micro-batches per evaluation (0 = no evaluation)")
    grad_clip: float = Field(1.0, ge=0.0, description="clip the global gradient L2 norm to this (0 = off)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available")
    compile: bool = Field(False, description="torch.compile the model")
    compile_mode: Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs"] = Field(
        "default", description="torch.compile's mode with train.compile (reduce-overhead: CUDA graphs replay each "
        "compiled forward and backward with one launch, for host-bound steps such as tensor parallelism)")
    compile_scope: Literal["auto", "model", "block"] = Field(
        "auto", description="what train.compile traces as one graph: model = the whole forward (its compiled "
        "backward hands every gradient over at its end, so data-parallel reductions start only then); block = each "
        "block apart, and the decoder's final norm and loss (each block's gradients reach the engine as its backward "
        "ends and their reductions overlap the rest, as in eager); auto = block where gradients are reduced over "
        "data-parallel ranks during backward (parallel.dp > 1, parallel.sync=allreduce, parallel.overlap_comm, no "
        "CUDA graphs, no replaying memory.recompute), else model. A pipeline stage always compiles its blocks; ZeRO-3 always each block's "
        "forward, its gather and free hooks eager around it")
    compile_overlap: bool = Field(False, description="with train.compile: inductor moves each collective's launch "
                                  "earlier and its wait later, within peak memory, so that work not needing it runs "
                                  "under it (a tensor-parallel backward's input-gradient all-reduce under the weight "
                                  "gradient's GEMM); torch's prototype passes, off by default (on with "
                                  "parallel.tp_overlap=chunked, whose pieces they schedule)")
    gc_every: int = Field(0, ge=0, description="Python's garbage collector: 0 = automatic, over the objects made "
                          "since training started only (the setup's are frozen, gc.freeze); N = automatic "
                          "collection off, every rank collects every N steps (reference cycles then live until "
                          "then)")
    deterministic: bool = Field(False, description="bitwise repeatable GPU runs (torch.use_deterministic_algorithms: "
                                "cuDNN attention's backward is not by default); some kernels run slower")

    @property
    def cuda_graphs(self) -> bool:
        """Does the compiled model replay as CUDA graphs (train.compile_mode=reduce-overhead)?"""
        return self.compile and self.compile_mode == "reduce-overhead"


class OptimConfig(Section):
    name: Literal["adamw", "sgd", "adafactor", "sm3"] = Field("adamw", description="optimizer (sm3: Anil et al. 2019, "
                                                             "row/column accumulators; wants a larger lr, ~0.03-0.2)")
    lr: float = Field(3e-3, gt=0.0, allow_inf_nan=False,
                      description="peak learning rate at optim.base_batch (before the scaling rule); "
                      "unset = the optimizer's own: adamw 3e-3, sgd 0.1, sm3 0.03, adafactor 0.1 (the cap of its "
                      "relative step size, a fraction of each parameter's RMS)")
    weight_decay: float = Field(0.1, ge=0.0, description="decoupled weight decay (matrices only; norms and biases get none)")
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW first-moment decay")
    beta2: float = Field(0.95, ge=0.0, lt=1.0, description="AdamW second-moment decay")
    eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon")
    kernel: Literal["auto", "torch"] = Field("auto", description="AdamW's step on CUDA fp32 parameters: auto = "
                                             "teratrain's Triton kernel (the same update, 1.3-1.4x torch's fused "
                                             "AdamW on an H200), torch = torch's fused kernel")
    momentum: float = Field(0.9, ge=0.0, lt=1.0,
                            description="SGD and SM3 momentum (0 = none: SM3 then keeps no full-size buffer)")
    schedule: Literal["constant", "cosine", "linear"] = Field("cosine", description="decay after warmup")
    warmup_steps: int = Field(30, ge=0, description="linear warmup steps (Goyal et al. 2017: lr_t = lr * t / T_w)")
    decay_steps: int | None = Field(None, ge=1, description="steps the warmup + decay schedule spans; unset = "
                                    "train.steps. Past it the lr stays at min_lr_ratio x lr (a resume to more --steps "
                                    "keeps the run's original length unless this is set)")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="final lr as a fraction of the peak (cosine/linear)")
    lr_scaling: Literal["none", "linear", "sqrt"] = Field("none", description="rule from optim.base_batch to train.global_batch")
    base_batch: int | None = Field(None, ge=1, description="global batch at which optim.lr was tuned (needed by lr_scaling)")


    @model_validator(mode="before")
    @classmethod
    def _default_lr(cls, data: Any) -> Any:
        """Each optimizer's own learning rate unless optim.lr is given (one rate does not fit them all:
        SM3's and Adafactor's steps are bounded by it per entry, SGD's are not normalized at all)."""
        if isinstance(data, dict) and data.get("lr") is None:
            data = {**data, "lr": DEFAULT_LR.get(data.get("name", "adamw"), DEFAULT_LR["adamw"])}
        return data


# Measured on the tiny test model (2 blocks of width 64, 30 steps of 8 x 64 tokens, 30 warmup steps, from
# 8.33 nats): adamw 6.89, sgd 7.04, sm3 6.73, adafactor 6.37; at AdamW's 3e-3 the others reach 8.07-8.29.
# Adafactor's lr caps the relative step rho_t = min(lr, 1/sqrt(t)) of Shazeer & Stern 2018 (alg. 4), whose
# update is rho_t x RMS(param): the paper's cap of 1e-2 moves a 0.02-scale weight by 2e-4 a step (8.20).
DEFAULT_LR = {"adamw": 3e-3, "sgd": 0.1, "sm3": 0.03, "adafactor": 0.1}


class MemoryConfig(Section):
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="compute precision")
    master_weights: bool | None = Field(None, description="keep low-precision params + fp32 master copies in the optimizer; unset = true for fp16, and for bf16 under ZeRO")
    recompute: Literal["none", "full", "every-k", "sqrt", "selective", "selective-ops",
                       "selective-ops-alternate"] = Field(
        "none", description="activation recomputation policy: selective recomputes the attention core; "
                            "selective-ops keeps every GEMM's and fused attention's output per block and "
                            "recomputes norms, casts and activations; selective-ops-alternate keeps only the "
                            "1st, 3rd, ... linear product's output of a block and runs the others again (torchtitan's "
                            "per-op policy; dense models) (memory/recompute.py)")
    recompute_every: int = Field(2, ge=1, description="blocks per recomputed segment for recompute=every-k")
    compress_activations: Literal["none", "lossless", "int8", "fp8"] = Field(
        "none", description="Gist-style compression of tensors saved for backward: lossless bit-packs dropout masks; "
                            "int8/fp8 also store block activations at 1 byte with per-128 scales (memory/compression.py)")
    fp8: Literal["none", "tensorwise", "rowwise"] = Field(
        "none", description="run the block linears' GEMMs (attention q/k/v/o, the dense MLP) in float8 through "
                            "torchao, with dynamic scales per tensor (tensorwise) or per row (rowwise); needs "
                            "memory.precision=bf16 and a GPU of compute capability >= 8.9; fast only with "
                            "train.compile (memory/fp8.py)")
    fp8_gather: bool = Field(True, description="with memory.fp8=tensorwise under parallel.zero=3: gather the float8 "
                             "linears' weights in float8, 1 byte an element, cast once a step with each weight's "
                             "global scale (parallel/zero_fp8.py); false gathers them in the compute dtype. "
                             "Has no effect elsewhere (rowwise casts each weight two ways)")
    cast_once: bool = Field(True, description="with several micro-batches a step: cast the float8 weights (tensorwise) "
                            "and the experts' weight stacks (fp32 parameters under autocast) once for all of them, "
                            "held from the first forward to the last backward (under CUDA graphs kept between steps, "
                            "at the addresses the graphs read; memory/step_casts.py); false casts "
                            "them in each micro-batch, which compiled holds less memory (the backward recasts)")
    fp8_emulate: bool = Field(False, description="with memory.fp8: emulate the float8 GEMMs in high precision "
                              "(any device, slowly), to check numerics where there are no float8 tensor cores")
    loss_chunks: int = Field(
        1, ge=0, description="the output head and cross-entropy fused and run over this many pieces of a micro-batch's "
        "tokens, so the (tokens x vocab) logits never exist whole (models/chunked_loss.py): 1 = off (whole logits), "
        "N = N pieces, 0 = about vocab / d_model pieces (each piece's logits the size of the hidden states); under "
        "parallel.tp > 1 the vocab-parallel loss splits the logits instead. Saves 4.6 GiB eager at llama-1b's shape "
        "but ran 3.6% slower there, and compiled no faster (bench/README.md, \"Training step against transformers\")")
    loss_scale_init: float = Field(2.0**16, gt=0.0, description="fp16 initial loss scale")
    loss_scale_window: int = Field(1000, ge=1, description="fp16: grow the scale x2 after this many clean steps")


class ParallelConfig(Section):
    auto: bool = Field(False, description="take every parallel.* degree, parallel.zero, parallel.offload, "
                       "train.micro_batch and memory.recompute not given here from the planner's fastest layout "
                       "that fits the job's processes and devices (docs/planner.md); given keys are kept")
    dp: int | None = Field(None, ge=1, description="data-parallel degree; unset = world size / (tp*pp*cp)")
    cp: int = Field(1, ge=1, description="context-parallel degree: ranks that split each sample's sequence, each "
                    "holding chunks i and 2cp-1-i of 2cp (causal load balance); they hold the same parameters, so "
                    "gradients are reduced, and ZeRO shards, over dp x cp (docs/context.md)")
    cp_form: Literal["ring", "all-to-all"] = Field(
        "ring", description="how attention spans the cp ranks: ring passes key/value chunks around the ranks, "
                            "overlapped with the attention of the chunk in hand, and merges partial results by "
                            "their log-sum-exp (any head count); all-to-all (Ulysses) swaps sequence shards for "
                            "head shards around attention (query heads per tp rank divisible by cp)")
    tp: int = Field(1, ge=1, description="tensor-parallel degree (ranks that split every layer's weights)")
    tp_form: Literal["megatron", "all-gather", "all-reduce"] = Field(
        "megatron", description="megatron: column- then row-parallel pairs (one all-reduce per attention/MLP each way); "
                                "all-gather / all-reduce: per-layer forms, every linear self-contained (outputs all-gathered / partial "
                                "products of inner-dim splits all-reduced)")
    sequence_parallel: bool | None = Field(None, description="norms, dropout and residuals on sequence shards under tp "
                                                             "(Korthikanti et al. 2022); unset = on for tp_form=megatron")
    tp_overlap: Literal["none", "chunked", "async"] = Field(
        "none", description="overlap tensor-parallel collectives with the matmuls that depend on them: chunked "
                            "splits each region's gather / reduce-scatter (all-reduce without sequence "
                            "parallelism) and its matmuls into parallel.tp_overlap_chunks pieces, one piece's "
                            "communication running while the next one computes (Wang et al. 2022; "
                            "parallel/tp_overlap.py); megatron form only. Under train.compile the pieces are "
                            "traced and inductor schedules them (train.compile_overlap's passes, turned on). "
                            "async: PyTorch's async TP, under train.compile with sequence parallelism on CUDA "
                            "GPUs: inductor fuses each sequence gather with the GEMMs that read it and each "
                            "GEMM with the reduce-scatter after it, the pieces moved by copy engines through "
                            "symmetric memory (no SMs taken from the GEMMs)")
    tp_overlap_chunks: int = Field(2, ge=1, description="pieces per overlapped collective for tp_overlap=chunked; "
                                                        "model.seq_len must be divisible by tp x this")
    pp: int = Field(1, ge=1, description="pipeline-parallel degree")
    ep: int = Field(1, ge=1, description="expert-parallel degree (divides dp: experts are spread over data-parallel ranks)")
    ep_overlap_chunks: int = Field(1, ge=1, description="pieces each MoE layer's all-to-all exchange is cut into at "
                                   "ep > 1, one piece's dispatch and combine running under another piece's experts, "
                                   "forward and backward (Tutel, DeepSpeed-MoE; parallel/expert.py); 1 = one "
                                   "exchange each way, nothing overlapped; no effect at ep=1 (slower than 1 where measured: "
                                   "docs/moe.md, \"Expert parallelism\")")
    ep_dedup: bool = Field(True, description="at ep > 1, send each token once to each rank holding one of its "
                           "chosen experts (its gates along), which runs them, weights and sums their outputs and "
                           "sends one row back, instead of one row per chosen expert each way (DeepSeek-V3; "
                           "parallel/expert_dedup.py): with top-8 of 128 experts at ep=4, 3.6 rows a token "
                           "instead of 8; false: one row per choice")
    zero: int = Field(0, ge=0, le=3, description="ZeRO stage: 1 shards optimizer state, 2 + gradients, 3 + parameters")
    offload: Literal["none", "optimizer", "params"] = Field("none", description="keep optimizer state (and ZeRO-3 params) in CPU memory")
    offload_threads: int = Field(0, ge=0, description="CPU threads each rank's host optimizer step runs on under "
                                 "offload; 0 = half the rank's share of the CPUs it may run on (the fastest in "
                                 "one measured call; torchrun alone gives every rank 1), a count given in "
                                 "OMP_NUM_THREADS, or torch's own count in a job of one process; the planner's "
                                 "host rates are measured at the default (memory/offload.py host_threads)")
    sync: Literal["allreduce", "local-sgd", "param-server"] = Field("allreduce", description="how data-parallel replicas synchronize")
    sync_every: int = Field(1, ge=1, description="local-sgd: steps between parameter averages")
    staleness: int | None = Field(None, ge=0, description="param-server: max steps a worker may run ahead of the slowest (0 = synchronous, unset = async)")
    num_servers: int = Field(1, ge=1, description="param-server: ranks acting as servers")
    bucket_mb: float = Field(25.0, gt=0.0, description="gradient bucket size in MiB")
    reduce_dtype: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="dtype of gradient reduction")
    grad_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="ZeRO: dtype of the gradient buffer micro-batches accumulate in (stage 1: the full "
                            "buffer, reduce-scattered in place; 2/3: the shard); bf16 halves it (the ZeRO paper's "
                            "2 bytes) at 8 mantissa bits, upcast to fp32 one group at a time for the update")
    dp_max_ctas: int | None = Field(None, ge=1, le=64, description="the most thread blocks (each takes an SM) NCCL "
                                    "may run one collective of the dp group on (the dense parameters' reductions, DDP's "
                                    "and ZeRO's, and ZeRO-3's gathers; expert and tied-embedding groups are left to "
                                    "NCCL): fewer leave more SMs to the matmuls those collectives overlap, and move "
                                    "fewer bytes a second; unset = NCCL's own choice. No effect on gloo")
    overlap_comm: bool = Field(True, description="launch gradient reductions from backward as buckets fill; false waits "
                                                 "for each one (to measure what the overlap saves)")
    timeout_s: float = Field(600.0, gt=0.0, description="seconds a collective or pipeline transfer may wait for its "
                             "peers; then the job ends with one sentence naming the rank, the operation and its group")
    schedule: Literal["naive", "gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "pipedream", "pipedream-2bw"] = Field(
        "1f1b", description="pipeline schedule when pp > 1 (parallel/pipeline/schedules.py; pipedream and "
                            "pipedream-2bw are asynchronous); unset, the planner searches 1f1b and "
                            "interleaved-1f1b")
    num_microbatches: int | None = Field(None, ge=1, description="micro-batches per optimizer step on each pipeline; "
                                         "unset = train.global_batch / (dp x train.micro_batch), which it must equal")
    virtual_stages: int = Field(1, ge=1, description="model chunks per pipeline rank (interleaved-1f1b): the blocks "
                                                     "are split into pp x virtual_stages stages")
    partition: Literal["layers", "profiled"] = Field("layers", description="split blocks into stages by count "
                                                     "(equal: pp x virtual_stages must divide model.n_layers) or by "
                                                     "time measured on the device under a memory cap (PipeDream's "
                                                     "DP, parallel/pipeline/partition.py)")
    stage_layers: list[int] | None = Field(None, description="blocks of each pipeline stage, pp x virtual_stages "
                                           "counts summing to model.n_layers (a fixed split; the first "
                                           "may be 0, the embedding alone, and the last, the head and the loss "
                                           "alone); unset = by "
                                           "parallel.partition, and a profiled split is recorded here in the run's "
                                           "config.toml, so --resume keeps it; chunk c of rank r is stage "
                                           "c x pp + r; parallel.auto writes the planner's balanced split here")
    weight_version_every: int | None = Field(None, ge=1, description="pipedream-2bw: micro-batches between weight "
                                             "versions (at least pp; unset = pp)")
    vertical_sync: bool = Field(False, description="pipedream: every stage uses the weight version a micro-batch "
                                                   "entered stage 0 with")
    pipeline_recv: Literal["at_use", "ahead"] = Field(
        "at_use", description="when a pipeline stage posts a receive: at_use, after the action before the one that "
                              "uses it (the transfer is on the critical path when the sender was early); ahead, one "
                              "action earlier (the transfer hides under that action, but under NCCL the receive's "
                              "kernel holds SMs while it waits for the peer, slowing that action)")

    @model_validator(mode="after")
    def _check_schedule(self) -> "ParallelConfig":
        from teratrain.parallel.pipeline.schedules import problem

        why = problem(self.schedule, self.pp, self.num_microbatches, self.virtual_stages,
                      self.weight_version_every, self.vertical_sync)
        if why:
            raise ConfigError(why)
        return self

    @property
    def use_sp(self) -> bool:
        """Sequence parallelism in effect: only with tp > 1, by default for the megatron form."""
        sp = self.tp_form == "megatron" if self.sequence_parallel is None else self.sequence_parallel
        return self.tp > 1 and sp


class DataConfig(Section):
    path: str | None = Field(None, description="text, JSON-lines (*.jsonl) or Parquet file, a folder written by "
                             "datasets' save_to_disk, a folder of them, a `teratrain tokenize` folder, or "
                             "pre-tokenized .bin; unset = the Python stdlib sources")
    sources: list[dict[str, Any]] | None = Field(None, description="a mixture instead of data.path: [{path, weight}, "
                                                 "...] (each path as data.path takes it; optional text_field), "
                                                 "samples drawn from each in proportion to its weight, one tokenizer "
                                                 "for all (data/mixture.py)")
    tokenizer: str | None = Field(None, description="tokenizer.json to use; unset = model.init_from's tokenizer.json if "
                                  "it has one, else train a byte-level BPE on the corpus (cached)")
    text_field: str = Field("text", description="JSON-lines, Parquet and datasets inputs: the field (column) of each "
                            "record that holds its text")
    val_fraction: float = Field(0.01, ge=0.0, lt=0.5, description="fraction of tokens held out for evaluation")
    cache_dir: str | None = Field(None, description="tokenizer/token cache; unset = ~/.cache/teratrain")
    document_mask: bool = Field(False, description="attention stops at document boundaries: a token sees only the "
                                "earlier tokens of its own document, the documents of a sample being cut by the "
                                "end-of-text token (data.eot_id); with parallel.cp, the chunks go to ranks by the "
                                "attention work they hold (docs/context.md)")
    eot_id: int | None = Field(None, ge=0, description="the end-of-text token id that ends each document, for "
                               "data.document_mask; unset = the tokenizer's <|endoftext|>")

    @field_validator("sources", mode="before")
    @classmethod
    def _check_sources(cls, value: Any) -> Any:
        from teratrain.data.mixture import check_sources

        return check_sources(value)

    @model_validator(mode="after")
    def _path_or_sources(self) -> "DataConfig":
        if self.path and self.sources:
            raise ConfigError("data.path and data.sources are both set; give data.path for one corpus or "
                              "data.sources for a mixture, not both.")
        return self


class CheckpointConfig(Section):
    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)  # `async`

    every: int | None = Field(None, ge=0, description="steps between checkpoints (0 = only at the end and on a stop "
                              "signal); unset = by time, every checkpoint.every_minutes")
    every_minutes: float = Field(10.0, gt=0.0, description="minutes of training between checkpoints when "
                                 "checkpoint.every is unset (the ranks agree each step whether it is time; not "
                                 "an asynchronous parameter server's, whose workers run steps apart)")
    keep: int = Field(2, ge=1, description="checkpoints kept on disk")
    async_: bool = Field(False, alias="async", description="copy the state to host memory (pinned on GPUs) and "
                         "write it from a background thread while training goes on; the next save waits for it, "
                         "and `latest` moves once every rank's files are written and fsynced (checkpoint/"
                         "background.py)")
    stop_timeout_s: float = Field(60.0, gt=0.0, description="seconds a job stopped by SIGTERM/SIGINT/SIGHUP has to "
                                  "finish its step and write a checkpoint before it exits without one (a second "
                                  "signal exits at once)")
    resume: Literal["auto"] | bool | None = Field(
        None, description="continue the run in --out from its newest checkpoint: true = always (--resume), false = "
                          "never (a run already there is refused), auto = when it holds one, else start it there "
                          "(--resume auto); unset = auto under plain torchrun, whose restarts (a failure, a node "
                          "joining or leaving) rerun the same command on every node, else false")

    @field_validator("resume", mode="before")
    @classmethod
    def _resume_mode(cls, value: Any) -> Any:
        if value is None or isinstance(value, bool) or value == "auto":
            return value
        raise ConfigError(f"checkpoint.resume must be true, false or \"auto\", got {value!r}; choose one of them.")


class MetricsConfig(Section):
    peak_tflops: float | None = Field(None, gt=0.0, description="per-device peak TFLOP/s for MFU; unset = GPU table (none on CPU)")
    tensorboard: bool = Field(False, description="also write TensorBoard events")
    wandb: bool = Field(False, description="also log to Weights & Biases (needs pip install wandb; wandb_sink.py)")
    wandb_project: str = Field("teratrain", description="the W&B project runs are logged to")
    wandb_mode: Literal["auto", "online", "offline"] = Field(
        "auto", description="auto = online where a W&B API key is configured (WANDB_API_KEY or wandb login), else "
                            "offline into <run>/wandb (upload later with wandb sync)")
    progress: bool = Field(True, description="progress on stderr: a bar on a terminal, else a plain line every "
                                             "train.log_every steps; false: neither (the summary and the end still print)")


class LoraConfig(Section):
    rank: int = Field(0, ge=0, le=1024, description="LoRA rank r (Hu et al. 2021; 0 = off): adapters B A of rank r on "
                                                     "the targeted linears, everything else frozen")
    alpha: float = Field(16.0, gt=0.0, description="LoRA scale numerator: the update is (alpha / rank) B A x")
    targets: list[str] = Field(["wq", "wk", "wv", "wo"], min_length=1,
                               description="block linears that get adapters (wq wk wv wo w1 w2 w3)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapters' input")
    base_dtype: Literal["param", "bf16"] = Field("param", description="storage of the frozen weights: param = the "
                                                                       "run's parameter dtype, bf16 = halved (autocast runs)")

    @model_validator(mode="after")
    def _check_targets(self) -> "LoraConfig":
        unknown = sorted(set(self.targets) - {"wq", "wk", "wv", "wo", "w1", "w2", "w3"})
        if unknown:
            raise ConfigError(f"lora.targets names unknown layers {unknown}; choose among wq wk wv wo w1 w2 w3.")
        if not self.rank:  # a setting that changes nothing while LoRA is off is a mistake, not a no-op
            moved = [k for k in ("targets", "alpha", "dropout", "base_dtype")
                     if getattr(self, k) != type(self).model_fields[k].default]
            if moved:
                raise ConfigError(f"lora.{moved[0]} is set but lora.rank=0 leaves LoRA off; set lora.rank (16 is "
                                  f"common) to train adapters, or remove lora.{moved[0]}.")
        return self


# memory.recompute policies whose backward reruns the blocks' forward (memory/recompute.py)
REPLAYING = ("full", "every-k", "sqrt")
# the per-op policies (memory/recompute.py): each block a checkpoint that keeps what its GEMMs made (all or every
# other one) and fused attention's output, and replays the rest
SELECTIVE_OPS = ("selective-ops", "selective-ops-alternate")


def resolved_compile_scope(scope: str, zero: int, reduces_in_backward: bool, graphs: bool, recompute: str) -> str:
    """train.compile_scope resolved: `auto` is `block` where the engine reduces gradients over data-parallel
    ranks from backward hooks (`reduces_in_backward`: parallel/data.py, zero.py) and nothing stops a block
    from being its own graph (CUDA graphs record the whole step; a replaying recompute policy checkpoints
    segments of blocks), else `model`; ZeRO-3 always `block` (its gather and free hooks are on the blocks).
    parallelize.py compiles by it and the planner counts saved tensors by it (planner/compiled.py)."""
    if zero == 3:
        return "block"
    if scope != "auto":
        return scope
    return "block" if reduces_in_backward and not graphs and recompute not in REPLAYING + SELECTIVE_OPS else "model"


def per_op_problem(recompute: str, schedule: str, pp: int, compiled: bool, scope: str, zero: int) -> str | None:
    """Why a per-op recomputation policy (SELECTIVE_OPS) cannot keep what it says here (one sentence with the
    fix), or None. It chooses by the ops a block dispatches inside its checkpoint: a block compiled apart (a
    pipeline stage's, ZeRO-3's, train.compile_scope=block) runs its kernels as one call the policy cannot see
    into, so nothing would be kept; ZB-H1's split backward replays each checkpointed block whole. The planner
    refuses the same layouts (planner/states.py check_layout)."""
    if recompute not in SELECTIVE_OPS:
        return None
    if pp > 1 and schedule in ("zb-h1", "zb_h1"):
        return (f"memory.recompute={recompute} keeps a block's GEMM outputs, and parallel.schedule=zb-h1's split "
                "backward replays each checkpointed block whole; set memory.recompute=full or parallel.schedule=1f1b.")
    if compiled and (pp > 1 or zero == 3 or scope == "block"):
        apart = "a pipeline stage" if pp > 1 else "ZeRO-3" if zero == 3 else "train.compile_scope=block"
        fix = ("set train.compile_scope=model" if pp == 1 and zero < 3
               else "set memory.recompute=full or train.compile=false")
        return (f"memory.recompute={recompute} keeps GEMM outputs by the ops a block dispatches, and under "
                f"train.compile {apart} compiles each block apart, hiding them; {fix}.")
    return None


def compile_scope_problem(compile: bool, scope: str, graphs: bool, recompute: str, zero: int) -> str | None:
    """Why train.compile cannot compile each block apart here (one sentence with the fix), or None:
    asked for with train.compile_scope=block, or needed by ZeRO-3, whose hooks are on the blocks. The
    planner refuses the same layouts through it (planner/states.py check_layout)."""
    zero3 = compile and zero == 3
    if scope != "block" and not zero3:
        return None
    if graphs:
        why = "train.compile_mode=reduce-overhead records one CUDA graph of the whole step"
    elif recompute in REPLAYING:
        why = f"memory.recompute={recompute} replays checkpointed blocks in backward, not tested with compiled blocks"
    elif zero3 and scope == "model":
        why = "train.compile_scope=model would trace ZeRO-3's gather and free hooks on every block"
    else:
        return None
    if zero3:
        return (f"train.compile with parallel.zero=3 compiles each block's forward apart, and {why}; set "
                "train.compile=false, parallel.zero<=2, or the other setting named.")
    return f"train.compile_scope=block compiles each block apart, and {why}; set train.compile_scope=auto."


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)

    def compile_scope_problem(self) -> str | None:
        """compile_scope_problem, then per_op_problem, of this config (checked when it is read and by
        parallel/support.py check_supported, for the layouts parallel.auto tries)."""
        t, p = self.train, self.parallel
        return (compile_scope_problem(t.compile, t.compile_scope, t.cuda_graphs, self.memory.recompute, p.zero)
                or per_op_problem(self.memory.recompute, p.schedule, p.pp, t.compile, t.compile_scope, p.zero))

    @model_validator(mode="after")
    def _check_cross(self) -> "Config":
        if self.optim.lr_scaling != "none" and self.optim.base_batch is None:
            raise ConfigError(f"optim.lr_scaling={self.optim.lr_scaling} needs optim.base_batch; set it to the batch "
                              "at which optim.lr was tuned.")
        if self.memory.compress_activations != "none" and self.train.compile:
            raise ConfigError("memory.compress_activations runs Python saved-tensor hooks that train.compile does not "
                              "trace; set train.compile=false or memory.compress_activations=none.")
        if self.train.compile_overlap and not self.train.compile:
            raise ConfigError("train.compile_overlap reorders what train.compile generates; set train.compile=true "
                              "or train.compile_overlap=false.")
        if self.train.compile_scope != "auto" and not self.train.compile:
            raise ConfigError(f"train.compile_scope={self.train.compile_scope} is a setting of train.compile; set "
                              "train.compile=true or leave train.compile_scope at auto.")
        why = self.compile_scope_problem()
        if why:
            raise ConfigError(why)
        if self.train.compile_mode != "default" and not self.train.compile:
            raise ConfigError(f"train.compile_mode={self.train.compile_mode} is a mode of train.compile; set "
                              "train.compile=true or leave train.compile_mode at default.")
        if self.memory.precision == "fp32" and self.memory.master_weights:
            raise ConfigError("memory.master_weights needs a low precision; set memory.precision=bf16 or fp16.")
        if self.checkpoint.async_ and self.parallel.sync == "param-server":
            raise ConfigError("checkpoint.async is not supported with parallel.sync=param-server, whose servers save "
                              "their own state as the workers ask; set checkpoint.async=false.")
        if self.lora.base_dtype == "bf16" and self.memory.precision != "bf16":
            raise ConfigError("lora.base_dtype=bf16 stores the frozen weights in bf16, which needs bf16 autocast; "
                              "set memory.precision=bf16 or lora.base_dtype=param.")
        self._check_fp8()
        p = self.parallel
        if self.lora.rank:
            if p.pp > 1:
                raise ConfigError(f"lora.rank={self.lora.rank} trains adapters beside frozen weights, which the "
                                  f"pipeline engine (parallel.pp={p.pp}) does not train; set parallel.pp=1 (LoRA "
                                  "trains with dp, ZeRO, tp and ep).")
            m = self.model
            q, kv = m.n_heads * m.head_width, m.kv_heads * m.head_width
            narrow = {"wq": min(m.d_model, q), "wk": min(m.d_model, kv), "wv": min(m.d_model, kv),
                      "wo": min(q, m.d_model), "w1": min(m.d_model, m.ffn_dim), "w3": min(m.d_model, m.ffn_dim),
                      "w2": min(m.ffn_dim, m.d_model)}
            least, name = min((narrow[t], t) for t in self.lora.targets)  # LoraConfig allows only these names
            if self.lora.rank > least:
                raise ConfigError(f"lora.rank={self.lora.rank} exceeds the {least} features of {name}'s narrower side, "
                                  f"so its adapter would not be low-rank; choose lora.rank <= {least}.")
        eot = self.data.eot_id
        if eot is not None and eot >= self.model.vocab_size:
            raise ConfigError(f"data.eot_id={eot} is no token of model.vocab_size={self.model.vocab_size}, so no "
                              "document would ever end; give the tokenizer's end-of-text id.")
        if self.memory.recompute in SELECTIVE_OPS and p.tp_overlap == "chunked":
            raise ConfigError(f"memory.recompute={self.memory.recompute} keeps GEMM outputs, and "
                              "parallel.tp_overlap=chunked writes its GEMMs into buffers it cannot keep; set "
                              "parallel.tp_overlap=none or memory.recompute=selective.")
        if self.memory.recompute == "selective-ops-alternate" and self.model.moe.num_experts > 1:
            raise ConfigError("memory.recompute=selective-ops-alternate alternates over a dense block's GEMMs, and "
                              "an MoE layer's GEMMs are not a fixed sequence; set memory.recompute=selective-ops.")
        # a given split is checked by its own rule (partition.counts_problem: its ends may hold no block)
        if p.stage_layers is None and self.model.n_layers < p.pp * p.virtual_stages:
            raise ConfigError(f"model.n_layers ({self.model.n_layers}) is fewer than the parallel.pp x "
                              f"parallel.virtual_stages = {p.pp * p.virtual_stages} pipeline stages; lower them.")
        if p.num_microbatches is not None and p.dp is not None:
            self.microbatches(p.dp)
        elif p.num_microbatches is not None and self.train.global_batch % (p.num_microbatches * self.train.micro_batch):
            raise ConfigError(f"train.global_batch ({self.train.global_batch}) must be dp x "
                              f"parallel.num_microbatches x train.micro_batch = dp x {p.num_microbatches} x "
                              f"{self.train.micro_batch}; change one of them.")
        return self

    def _check_fp8(self) -> None:
        m = self.memory
        if m.fp8 == "none":
            if m.fp8_emulate:
                raise ConfigError("memory.fp8_emulate emulates memory.fp8's GEMMs; set memory.fp8=tensorwise "
                                  "(or rowwise) or memory.fp8_emulate=false.")
            return
        if m.precision != "bf16":
            raise ConfigError(f"memory.fp8={m.fp8} runs the block linears in float8 inside bf16 training, and "
                              f"memory.precision is {m.precision}; set memory.precision=bf16.")
        if self.lora.rank:
            raise ConfigError(f"memory.fp8={m.fp8} casts trainable weights to float8 each step, and lora.rank="
                              f"{self.lora.rank} trains adapters beside frozen ones; set memory.fp8=none.")
        if self.parallel.tp_overlap == "chunked":
            raise ConfigError(f"parallel.tp_overlap=chunked runs its own bf16 GEMMs, which memory.fp8={m.fp8} "
                              "cannot reach; set parallel.tp_overlap=none (or async, under train.compile).")
        tokens = self.train.micro_batch * self.model.seq_len // self.parallel.cp  # the weight gradient's inner dim
        if tokens % 16:
            raise ConfigError(f"memory.fp8={m.fp8} multiplies each weight's gradient over the tokens of a micro-batch "
                              f"(train.micro_batch x model.seq_len / parallel.cp = {tokens}), and float8 GEMMs take "
                              "an inner dimension that is a multiple of 16; change train.micro_batch or model.seq_len.")

    def microbatches(self, dp: int) -> int:
        """Micro-batches per optimizer step on each pipeline at data-parallel degree `dp`, checked
        against parallel.num_microbatches and the schedule (call before launch, when dp is known)."""
        t, p = self.train, self.parallel
        m, rest = divmod(t.global_batch, dp * t.micro_batch)
        if rest or m == 0 or (p.num_microbatches is not None and m != p.num_microbatches):
            want = f"a multiple of dp x train.micro_batch = {dp * t.micro_batch}"
            if p.num_microbatches:
                n = dp * p.num_microbatches * t.micro_batch
                want = f"dp x parallel.num_microbatches x train.micro_batch = {dp} x {p.num_microbatches} x " \
                       f"{t.micro_batch} = {n}"
            raise ConfigError(f"train.global_batch ({t.global_batch}) must be {want}; change one of them.")
        from teratrain.parallel.pipeline.schedules import problem

        why = problem(p.schedule, p.pp, m, p.virtual_stages, p.weight_version_every, p.vertical_sync)
        if why:
            raise ConfigError(why)
        return m

    @property
    def schedule_steps(self) -> int:
        """Steps the learning-rate schedule spans (optim.decay_steps, else train.steps)."""
        return self.optim.decay_steps or self.train.steps

    @property
    def use_master_weights(self) -> bool:
        """Low-precision params with fp32 master copies (the rule: memory/precision.py)."""
        from teratrain.memory.precision import uses_master_weights

        return uses_master_weights(self.memory.precision, self.parallel.zero, self.parallel.offload,
                                   self.memory.master_weights)
