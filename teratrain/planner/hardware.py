"""Every hardware number the planner assumes: the datasheet terms here, the fitted and measured constants
in calibration/<card>.toml (each with the term it scales, the runs it was fitted on and its error there).
Each can be overridden with `teratrain plan --hw KEY=VALUE` (e.g. `--hw inter_node_gbps=25`).

Peak FLOP/s come from metrics.GPU_PEAK_TFLOPS (vendor datasheets, dense). Bandwidths are
effective per-GPU figures, one direction, in GB/s (1e9 bytes/s):
- nvlink_gbps: H100/H200 NVLink 4 is 900 GB/s bidirectional per GPU, ~450 per direction (A100: 600, 300);
- pcie_gbps: PCIe gen5 x16 ~55 GB/s achieved host<->device with pinned memory (A100: gen4, ~25);
- inter_node_gbps: one 400 Gb/s InfiniBand NIC per GPU (8 per node) = 50 GB/s (A100 nodes: 200 Gb/s, 25). A ring
  collective (all-reduce, reduce-scatter, all-gather) across nodes runs one ring per NIC, so a group with k
  members on each node crosses at k NICs' bandwidth, at most NVLink's (NCCL: 4 NICs of 12.5 GB/s give
  48 GB/s); a send or an all-to-all crosses at its GPU's own NIC;
- hbm_gbps: datasheet HBM bandwidth (H100 SXM 3350, H200 4800, A100-80GB 2039).
alpha_*_s are per-message latencies of the alpha-beta model (Hockney 1994): t = alpha + bytes / beta.

Measured terms: `bench/planner_validate.py --gpus N` times each collective on the machine and fits
one alpha (per ring step) and one bus bandwidth per kind (`<kind>_alpha_s`, `<kind>_gbps`); given
(`teratrain plan --hw-file RESULT.json`, or `--hw all_reduce_gbps=...`), they replace nvlink_gbps
and alpha_intra_s for that kind inside a node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from pathlib import Path

from teratrain.metrics import GPU_PEAK_TFLOPS

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "p2p")
RINGS = ("all_reduce", "reduce_scatter", "all_gather")  # across nodes: a ring over each member's NIC
CALIBRATION = Path(__file__).with_name("calibration")  # <card>.toml, common.toml: packaged data


def calibration(name: str) -> dict[str, dict]:
    """The entries of calibration/<name>.toml: {constant: {"value", "term", "source", "runs", "fit_error"}}."""
    path = CALIBRATION / f"{name}.toml"
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise RuntimeError(f"{path} cannot be read ({e}); reinstall teratrain or restore the file from git.") from None


def calibrated(name: str) -> dict[str, float]:
    """{constant: value} of calibration/<name>.toml."""
    return {key: entry["value"] for key, entry in calibration(name).items()}


NOT_MEASURED = "not measured on this card"  # in an entry's source: the value is another card's


def borrowed(name: str) -> list[str]:
    """The constants of calibration/<name>.toml that hold another card's value (their source says so)."""
    return [key for key, entry in calibration(name).items() if NOT_MEASURED in entry.get("source", "")]


_REFERENCE = calibrated("h200")  # the GPU dataclass's defaults: the card most constants were fitted on


@dataclass(frozen=True, kw_only=True)
class GPU:
    name: str
    memory_gib: float  # what torch.cuda.get_device_properties reports as total memory
    peak_tflops: dict  # by precision, from metrics.GPU_PEAK_TFLOPS
    hbm_gbps: float
    nvlink_gbps: float
    pcie_gbps: float
    inter_node_gbps: float
    gpus_per_node: int = 8
    alpha_intra_s: float = 5e-6
    alpha_inter_s: float = 15e-6
    # Collectives as measured inside a node (see the module docstring); None: nvlink_gbps, alpha_intra_s
    all_reduce_gbps: float | None = None
    all_reduce_alpha_s: float | None = None
    reduce_scatter_gbps: float | None = None
    reduce_scatter_alpha_s: float | None = None
    all_gather_gbps: float | None = None
    all_gather_alpha_s: float | None = None
    all_to_all_gbps: float | None = None
    all_to_all_alpha_s: float | None = None
    p2p_gbps: float | None = None
    p2p_alpha_s: float | None = None
    # Fitted and measured constants: the defaults are the H200's, each card's preset takes its own from
    # calibration/<card>.toml (value, the term it scales, the runs it was fitted on, its error there).
    # Sustained fraction of the datasheet peak on the model FLOPs: with bf16 it rises with the width d
    # (the inner dimension of most matmuls: short K loops keep tensor cores waiting),
    # eff = flops_max * d / (d + flops_d_half); fp32 runs CUDA-core GEMMs close to their lower peak.
    flops_max: float = _REFERENCE["flops_max"]  # bf16/fp16 efficiency at infinite width
    flops_d_half: float = _REFERENCE["flops_d_half"]  # width at which bf16/fp16 reaches half of flops_max
    flops_efficiency_fp32: float = _REFERENCE["flops_efficiency_fp32"]
    moe_efficiency: float = _REFERENCE["moe_efficiency"]  # MoE expert FLOPs' rate, share of the dense rate
    # Compiled, the experts' grouped GEMM at the dense rate x w / (w + grouped_half_work), w = an expert's
    # rows times its width per micro-batch (bench/calibrate/grouped_gemm.py)
    grouped_half_work: float = _REFERENCE["grouped_half_work"]
    # memory.fp8: a float8 GEMM (torch._scaled_mm, bf16 output) against the bf16 GEMM of the same shape,
    # by recipe. Cards without float8 tensor cores have no "fp8" peak (metrics.GPU_PEAK_TFLOPS): the
    # planner refuses memory.fp8 on them.
    fp8_speedup_tensorwise: float = _REFERENCE["fp8_speedup_tensorwise"]
    fp8_speedup_rowwise: float = _REFERENCE["fp8_speedup_rowwise"]
    mem_efficiency: float = _REFERENCE["mem_efficiency"]  # fraction of HBM bandwidth the optimizer sweep reaches
    # GPU cost of one eager op besides its FLOPs (launch, small elementwise kernels between matmuls), per
    # op the model issues (time.OPS_PER_BLOCK)
    op_overhead_s: float = _REFERENCE["op_overhead_s"]
    # Host time to issue one eager op (Python, dispatcher, autocast, launch), and the cost of one
    # tensor-parallel collective on the critical path (its autograd function, the watchdog's
    # registration, the NCCL launch; the compute stream waits on it at once, so the ranks' host skew
    # and the queue's refill land there too): the GPU waits on these where its own work per op is
    # short. host_collective_s predicts without explaining: read it as what one tp collective costs a
    # step on the machine it was fitted on. A run's host probe (refit.fit_host) replaces both.
    host_op_s: float = _REFERENCE["host_op_s"]
    host_collective_s: float = _REFERENCE["host_collective_s"]
    # Host time teratrain's AdamW kernel (optim/adamw_kernel.py) cost a parameter tensor it stepped while it was
    # launched a tensor at a time (its checks and its Triton launch): the runs recorded so (Training.adamw_per_tensor)
    # had a model of many small tensors paced by it; launched once a group, the kernel does not read it
    host_optimizer_tensor_s: float = _REFERENCE["host_optimizer_tensor_s"]
    # Host time of one data-parallel engine launch (a bucket's all-reduce, a ZeRO group's reduce-scatter
    # or gather, with its hook): measured by the host probe's ZeRO-3 row where a run has one; None:
    # time.DP_LAUNCH_SHARE of host_collective_s
    host_launch_s: float | None = None
    # Allowance for what torch.cuda.max_memory_allocated does not see: the CUDA context and library
    # handles outside the allocator (NCCL adds more on several GPUs), and fragmentation, the
    # "fragmented memory" of ZeRO sec. 3.2: the allocator's reserved bytes over the allocated peak
    context_gib: float = _REFERENCE["context_gib"]
    fragmentation: float = _REFERENCE["fragmentation"]
    # fused CPU AdamW, parameters per second per rank when 8 ranks share a node's CPUs
    host_adam_params_per_s: float = _REFERENCE["host_adam_params_per_s"]
    # the host's fp32 -> compute-dtype cast of each stepped master shard into the pinned staging
    # buffer (memory/offload.py), parameters per second per rank; 0: twice host_adam_params_per_s
    # (one CPU core: fused AdamW 0.57, the cast 1.16 G params/s; bench/machine.py measures both)
    host_cast_params_per_s: float = 0.0

    def host_cast_rate(self) -> float:
        """host_cast_params_per_s, or twice the AdamW rate where not measured (0)."""
        return self.host_cast_params_per_s or 2 * self.host_adam_params_per_s

    def peak_flops(self, precision: str) -> float:
        return self.peak_tflops[precision] * 1e12

    def efficiency(self, precision: str, d_model: int) -> float:
        if precision == "fp32":
            return self.flops_efficiency_fp32
        return self.flops_max * d_model / (d_model + self.flops_d_half)

    def sustained_flops(self, precision: str, d_model: int) -> float:
        return self.peak_flops(precision) * self.efficiency(precision, d_model)

    def link(self, kind: str, span: int, n: int = 1) -> tuple[float, float]:
        """(GB/s, alpha per ring step) of collective `kind` over a group of `n` ranks spread evenly over `span`
        consecutive GPUs: inside a node the kind's measured terms when given, else NVLink's; across nodes
        the NICs of the group's members on its emptiest node for a ring collective (RINGS), at most the rate
        inside a node, one NIC otherwise."""
        gbps, alpha = getattr(self, f"{kind}_gbps"), getattr(self, f"{kind}_alpha_s")
        inside = self.nvlink_gbps if gbps is None else gbps
        if span > self.gpus_per_node:
            stride = max(1, span // max(1, n))  # the ring's slowest node: the one holding the fewest members
            fewest = min(self.gpus_per_node, span % self.gpus_per_node or self.gpus_per_node) // stride
            nics = max(1, fewest) if kind in RINGS else 1
            return min(nics * self.inter_node_gbps, max(self.inter_node_gbps, inside)), self.alpha_inter_s
        return inside, (self.alpha_intra_s if alpha is None else alpha)


def _gpu(name: str, table_key: str, **kw) -> GPU:
    """A card's preset: the datasheet terms given, the fitted ones from calibration/<name>.toml."""
    return GPU(name=name, peak_tflops=GPU_PEAK_TFLOPS[table_key], **calibrated(name), **kw)


GPUS = {
    "h100": _gpu("h100", "H100", memory_gib=79.2, hbm_gbps=3350, nvlink_gbps=450, pcie_gbps=55, inter_node_gbps=50),
    "h200": _gpu("h200", "H200", memory_gib=140.4, hbm_gbps=4800, nvlink_gbps=450, pcie_gbps=55, inter_node_gbps=50),
    "a100": _gpu("a100", "A100", memory_gib=79.2, hbm_gbps=2039, nvlink_gbps=300, pcie_gbps=25, inter_node_gbps=25),
}


def gpu_for_device(device_name: str, total_bytes: int) -> GPU:
    """The preset whose name the device's name contains (H100 constants for any other GPU), with the
    device's own memory."""
    upper = device_name.upper()
    gpu = next((g for key, g in GPUS.items() if key.upper() in upper), GPUS["h100"])
    return replace(gpu, memory_gib=total_bytes / 2**30)


def gpu_with(name: str, overrides: dict[str, float] | None = None) -> GPU:
    """A preset with `--hw key=value` overrides applied (unknown keys raise KeyError)."""
    gpu = GPUS[name]
    if not overrides:
        return gpu
    known = {f.name for f in fields(GPU)} - {"name", "peak_tflops"}
    bad = [k for k in overrides if k not in known]
    if bad:
        raise KeyError(bad[0])
    for key, value in overrides.items():
        low, high = _RANGES.get(key, (0.0, math.inf))
        lo_ok = value >= low if key in _LOW_INCLUDED else value > low
        if not (math.isfinite(value) and lo_ok and value <= high):
            floor = f">= {low:g}" if key in _LOW_INCLUDED else f"> {low:g}"
            raise ValueError(f"--hw {key}={value:g} is out of range; give a number {floor}"
                             + (f" and <= {high:g}" if math.isfinite(high) else "") + ".")
    return replace(gpu, **overrides)


# latencies, allowances and overheads may be zero (host_cast_params_per_s: 0 = twice the AdamW rate);
# fractions of a peak are at most 1; the rest divide
_LOW_INCLUDED = {"alpha_intra_s", "alpha_inter_s", "op_overhead_s", "host_op_s", "host_collective_s", "host_launch_s",
                 "context_gib",
                 "host_cast_params_per_s",
                 "fragmentation", "gpus_per_node", *(f"{k}_alpha_s" for k in COLLECTIVES)}
_RANGES = {"flops_max": (0.0, 1.0), "moe_efficiency": (0.0, 1.0), "flops_efficiency_fp32": (0.0, 1.0),
           "mem_efficiency": (0.0, 1.0), "gpus_per_node": (1.0, math.inf)}


def hw_keys() -> list[str]:
    return sorted({f.name for f in fields(GPU)} - {"name", "peak_tflops"})


# Host memory of a GPU node `teratrain plan` assumes when it plans for GPUs other than this machine's:
# 256 GiB per GPU, the 2 TiB of an 8-GPU DGX H100/H200 node (--host-mem gives the real figure).
HOST_GIB_PER_GPU = 256.0


def local_gpu_count() -> int:
    """GPUs this machine has (0 without CUDA); no CUDA context is made."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def host_memory_gib() -> float | None:
    """This machine's memory in GiB (MemTotal, capped by a cgroup v2 limit), or None where unknown.
    The total, not what is free now: every rank of a job, started at slightly different moments,
    must plan the same layout, and the pinned buffers are allocated before the run grows."""
    total = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max" and total is not None:
            total = min(total, int(limit))
    except (OSError, ValueError):
        pass
    return total / 2**30 if total else None


def read_hw_file(path: str) -> tuple[dict[str, float], str | None]:
    """Hardware terms from a JSON file: a `bench/planner_validate.py` result (its "hw" object, which
    holds what the run measured, and its "gpu" preset) or a flat {"key": number} object. Returns
    (overrides, preset name or None); raises ValueError with one sentence on bad content."""
    import json

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--hw-file {path} cannot be read as JSON ({e}); pass a planner_validate result or a "
                         "{\"key\": number} object.") from None
    if not isinstance(data, dict):
        raise ValueError(f"--hw-file {path} holds no JSON object; pass a planner_validate result or a "
                         "{\"key\": number} object.")
    hw, preset = data.get("hw", data), data.get("gpu_preset")
    if not isinstance(hw, dict):
        raise ValueError(f"--hw-file {path}: \"hw\" is not an object of hardware terms.")
    known = set(hw_keys())
    bad = [k for k, v in hw.items() if k not in known or isinstance(v, bool) or not isinstance(v, (int, float))]
    if bad:
        raise ValueError(f"--hw-file {path}: {bad[0]!r} is not a hardware term with a number; use keys among "
                         f"{', '.join(sorted(known))}.")
    return {k: (int(v) if k == "gpus_per_node" else float(v)) for k, v in hw.items()}, preset
