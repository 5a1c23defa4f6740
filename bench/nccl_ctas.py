"""NCCL with its thread blocks capped (parallel.dp_max_ctas: ncclConfig_t.maxCTAs through
ProcessGroupNCCL.Options): does the cap take, and what a reduce-scatter (fp32) and an all-gather (bf16)
of one Llama-8B block's parameters take under each cap. GPUs only (NCCL); rank 0 prints one JSON object.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node 4 bench/nccl_ctas.py [--out r.json]
"""
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from teratrain.compat import all_gather_single, nccl_options, reduce_scatter_single  # noqa: E402

if not torch.cuda.is_available():
    raise SystemExit("bench/nccl_ctas.py measures NCCL: run it under torchrun on CUDA GPUs.")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
w, r = dist.get_world_size(), dist.get_rank()
n = 218_112_000 // w * w  # one Llama-8B block's parameters
out = {}
for cap in (None, 32, 16, 8, 4):
    g = dist.new_group(list(range(w)), pg_options=nccl_options(cap))
    full = torch.ones(n, device="cuda")
    shard = torch.empty(n // w, device="cuda")
    pb = torch.ones(n // w, device="cuda", dtype=torch.bfloat16)
    gb = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    row = {}
    for name, fn, nbytes in (("reduce_scatter_fp32", lambda: reduce_scatter_single(shard, full, group=g), 4 * n),
                             ("all_gather_bf16", lambda: all_gather_single(gb, pb, group=g), 2 * n)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / 10
        row[name] = {"ms": round(dt * 1e3, 3), "busbw_gbps": round(nbytes * (w - 1) / w / dt / 1e9, 1)}
    out[str(cap)] = row
    del full, shard, pb, gb
if r == 0:
    text = json.dumps({"bench": "nccl_ctas", "gpus": w, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "nccl": ".".join(map(str, torch.cuda.nccl.version())), "elements": n, "caps": out}, indent=1)
    print(text)
    if "--out" in sys.argv:
        Path(sys.argv[sys.argv.index("--out") + 1]).write_text(text)
dist.destroy_process_group()
