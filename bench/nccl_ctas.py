"""NCCL with its thread blocks capped (parallel.dp_max_ctas: ncclConfig_t.maxCTAs through
ProcessGroupNCCL.Options): does the cap take, and what a reduce-scatter (fp32) and an all-gather (bf16)
of one Llama-8B block's parameters take under each cap (bench/machine.py `time_one`: the slowest rank's
mean of 10 calls). GPUs only (NCCL); rank 0 prints one JSON object.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node 4 bench/nccl_ctas.py [--out r.json]
"""
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import time_one  # noqa: E402
from teratrain.compat import nccl_options  # noqa: E402
from teratrain.planner.comm import FRACTION  # noqa: E402

BLOCK = 218_112_000  # one Llama-8B block's parameters
CASES = (("reduce_scatter", torch.float32, "fp32"), ("all_gather", torch.bfloat16, "bf16"))

if not torch.cuda.is_available():
    raise SystemExit("bench/nccl_ctas.py measures NCCL: run it under torchrun on CUDA GPUs.")
device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
torch.cuda.set_device(device)
dist.init_process_group("nccl", device_id=device)
w = dist.get_world_size()
out = {}
for cap in (None, 32, 16, 8, 4):
    group = dist.new_group(list(range(w)), pg_options=nccl_options(cap))
    row = {}
    for kind, dtype, short in CASES:
        nbytes = BLOCK * dtype.itemsize
        t = time_one(kind, nbytes, device, 10, group, dtype)
        row[f"{kind}_{short}"] = {"ms": round(t * 1e3, 3), "busbw_gbps": round(FRACTION[kind](w) * nbytes / t / 1e9, 1)}
    out[str(cap)] = row
if dist.get_rank() == 0:
    text = json.dumps({"bench": "nccl_ctas", "gpus": w, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "nccl": ".".join(map(str, torch.cuda.nccl.version())), "elements": BLOCK, "caps": out}, indent=1)
    print(text)
    if "--out" in sys.argv:
        Path(sys.argv[sys.argv.index("--out") + 1]).write_text(text)
dist.destroy_process_group()
