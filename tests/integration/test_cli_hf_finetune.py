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
from tests.integration.runner import assert_user_error, metrics

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


def test_a_256_token_model_fine_tunes_on_text_with_the_byte_tokenizer(cli, tmp_path):
    """A model of 256 tokens and no tokenizer.json trains on text one byte a token; one of fewer is
    refused in one sentence that names the fixes."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("".join(f"line {i}: naïve café\n" for i in range(400)))
    sets = [f"data.path={str(corpus)!r}", f"data.cache_dir={str(tmp_path / 'c')!r}", "model.seq_len=32",
            "train.global_batch=4", "train.micro_batch=2", "train.eval_batches=0", "metrics.progress=false"]
    for vocab in (256, 200):
        save_llama(tmp_path / f"hf{vocab}", vocab_size=vocab)
    run = tmp_path / "run"
    cli("train", "--out", run, "--steps", 2, *[a for s in sets + [f"model.init_from={str(tmp_path / 'hf256')!r}"]
                                              for a in ("--set", s)], in_process=True)
    assert [r["step"] for r in metrics(run)] == [1, 2]
    assert json.loads((run / "tokenizer.json").read_text())["model"]["vocab"]["a"] == ord("a")
    proc = cli("train", "--out", tmp_path / "small", "--steps", 2, expect_rc=None, in_process=True,
               *[a for s in sets + [f"model.init_from={str(tmp_path / 'hf200')!r}"] for a in ("--set", s)])
    assert_user_error(proc, "model.vocab_size=200", "data.tokenizer")
