"""The head GEMMs at a vocabulary that is not a multiple of 64: one GPU, eager, bf16 autocast, the chunked loss.

GPT-2's 50,257 rows leave every row of the logits and of their gradient misaligned for the GEMMs. Each preset is
trained from the same weights seed and tokens (drawn below the preset's vocabulary) three ways, in rounds that
alternate them in one process:
- `unpadded`: its vocabulary as it is, the GEMMs over V rows (`models/chunked_loss.py` ALIGN set to 1);
- `padded`: its vocabulary as teratrain trains it, the GEMMs over V rounded up to ALIGN rows, the padded logits
  -inf (the same loss);
- `vocab_rounded`: `model.vocab_size` itself rounded up (nanoGPT's 50,304: the softmax over the extra rows too).

    python bench/vocab_alignment.py --presets gpt2-124m,gpt2-350m --out FILE     # --smoke: tiny, on the CPU

Step = median of --steps steps after 3, synchronized; `*_over_unpadded`: the unpadded step over each row's.
"""

from __future__ import annotations

import argparse
import statistics

import torch
# common puts the checkout on sys.path
from common import emit, env_info, time_steps

from teratrain.config import load_config  # noqa: E402
from teratrain.measure import build_engine  # noqa: E402
from teratrain.models import chunked_loss  # noqa: E402
from teratrain.optim.engine import train_step  # noqa: E402

SMOKE = ["model.n_layers=1", "model.seq_len=32", "model.d_model=32", "model.n_heads=2"]
FORMS = ("unpadded", "padded", "vocab_rounded")


def step_ms(preset: str, form: str, micro_batch: int, steps: int, dev: torch.device, smoke: bool) -> float:
    vocab = load_config(None, [f"model.preset={preset}"]).model.vocab_size
    sets = [f"model.preset={preset}", "memory.precision=bf16", "train.compile=false",
            f"train.micro_batch={micro_batch}", f"train.global_batch={micro_batch}"] + (SMOKE if smoke else [])
    if form == "vocab_rounded":
        sets.append(f"model.vocab_size={chunked_loss.padded_vocab(vocab)}")
    cfg = load_config(None, sets)
    model, engine = build_engine(cfg, dev)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, vocab, (micro_batch, cfg.model.seq_len), generator=g).to(dev) for _ in range(2))
    align, chunked_loss.ALIGN = chunked_loss.ALIGN, 1 if form == "unpadded" else chunked_loss.ALIGN
    try:
        times = time_steps(lambda: train_step(model, engine, [(x, y)], "bf16", 1e-4), 3, steps, dev)
    finally:
        chunked_loss.ALIGN = align
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="gpt2-124m,gpt2-350m")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    out = {"bench": "vocab_alignment", **env_info(dev), "align": chunked_loss.ALIGN, "micro_batch": args.micro_batch,
           "mode": "eager", "rows": {}}
    for preset in args.presets.split(","):
        row = {form: [] for form in FORMS}
        for _ in range(args.rounds):
            for form in FORMS:
                row[form].append(round(step_ms(preset, form, args.micro_batch, args.steps, dev, args.smoke), 2))
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
        base = statistics.median(row["unpadded"])
        row.update({f"{form}_over_unpadded": round(base / statistics.median(row[form]), 3) for form in FORMS[1:]})
        out["rows"][preset] = row
        print(preset, row, flush=True)
    emit(out, args.out)


if __name__ == "__main__":
    main()
