"""Fine-tuning a Hugging Face model through the CLI: `model.init_from` on a folder with its own
tokenizer.json and a JSON-lines corpus. The first logged loss equals transformers' loss of that model on
the same first batch (fp32, 1e-5); the run keeps the folder's tokenizer; a resume does not read the
folder's weights any more (every weight comes from the checkpoint)."""

import json

import pytest
import torch
import torch.nn.functional as F

from teratrain.config import load_config
from teratrain.data.loader import Batches, prepare
from teratrain.data.tokenizer import train_bpe
from tests.hf_models import save_llama
from tests.integration.runner import metrics

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


def test_fine_tune_a_hf_llama_on_jsonl_then_resume_without_its_weights(cli, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": i, "text": f"def f{i}(x):\n    return x * {i} + {i % 7}\n"}) + "\n"
                              for i in range(2000)))
    hf_dir = tmp_path / "hf"
    hf = save_llama(hf_dir, vocab_size=300, max_position_embeddings=64)
    train_bpe([corpus], 300, hf_dir / "tokenizer.json")
    run = tmp_path / "run"
    sets = [f"model.init_from={str(hf_dir)!r}", f"data.path={str(corpus)!r}", f"data.cache_dir={str(tmp_path / 'c')!r}",
            "model.seq_len=32", "train.eval_batches=0", "optim.lr=1e-3", "optim.warmup_steps=0"]
    cli(*["train", "--out", run, "--steps", "3"], *[a for s in sets + ["metrics.progress=false"] for a in ("--set", s)])
    assert (run / "tokenizer.json").read_text() == (hf_dir / "tokenizer.json").read_text()

    cfg = load_config(run / "config.toml")
    data = prepare(cfg.data, cfg.model.vocab_size)
    x, y = Batches(data.train, cfg.model.seq_len, cfg.train.seed, cfg.train.global_batch).get(0, 0, cfg.train.global_batch)
    with torch.no_grad():
        expected = float(F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()))
    first = metrics(run)[0]["loss"]
    assert abs(first - expected) <= 1e-5 * expected, (first, expected)

    for f in hf_dir.glob("*.safetensors"):  # the resumed run reads its weights from the checkpoint only
        f.unlink()
    cli(*["train", "--out", run, "--steps", "5", "--resume"],
        *[a for s in sets + ["metrics.progress=false"] for a in ("--set", s)])
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5]
