"""The fused, chunked head + cross-entropy (models/chunked_loss.py) against F.cross_entropy of the whole
logits: loss and both gradients, in fp32 (to fp32 rounding: rel. 1e-5) and under bf16 autocast (the
plain path in the same autocast: loss rel. 2e-3, gradients 2e-2 of their largest entry), with ignored
targets, uneven pieces, a frozen head, no grad, inside the model and under torch.compile."""

import pytest
import torch
import torch.nn.functional as F

from teratrain.config_base import ConfigError
from teratrain.models.chunked_loss import IGNORE_INDEX, auto_chunks, chunked_lm_loss
from teratrain.parallel.support import check_supported
from tests.helpers import make_config, small_model

FP32_RTOL = 1e-5
BF16_LOSS_RTOL, BF16_GRAD_TOL = 2e-3, 2e-2


def _inputs(B=3, T=7, d=16, V=37, ignore=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, d, generator=g, requires_grad=True)
    w = (torch.randn(V, d, generator=g) * 0.3).requires_grad_()
    y = torch.randint(0, V, (B, T), generator=g)
    if ignore:
        y[0, :3] = IGNORE_INDEX
        y[2, -1] = IGNORE_INDEX
    return h, w, y


def _plain(h, w, y):
    return F.cross_entropy((h @ w.t()).float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)


def _grads(loss_fn, h, w, y):
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = loss_fn(h, w, y)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _close(a, b, tol):
    return (a - b).abs().max().item() <= tol * b.abs().max().item()


@pytest.mark.parametrize("chunks", [1, 2, 5, 21, 100])
@pytest.mark.parametrize("ignore", [False, True])
def test_fp32_matches_cross_entropy(chunks, ignore):
    h, w, y = _inputs(ignore=ignore)
    want = _grads(_plain, h, w, y)
    got = _grads(lambda h, w, y: chunked_lm_loss(h, w, y, chunks), h, w, y)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=FP32_RTOL, atol=FP32_RTOL * b.abs().max().item())


def test_bf16_autocast_matches_the_plain_path_in_the_same_autocast():
    h, w, y = _inputs(B=4, T=32, d=64, V=300)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _grads(lambda h, w, y: F.cross_entropy(F.linear(h, w).float().flatten(0, 1), y.flatten(),
                                                      ignore_index=IGNORE_INDEX), h, w, y)
        got = _grads(lambda h, w, y: chunked_lm_loss(h, w, y, 4), h, w, y)
    assert abs(got[0] - want[0]) <= BF16_LOSS_RTOL * abs(want[0])
    assert got[1].dtype == want[1].dtype == torch.float32 and got[2].dtype == torch.float32
    assert _close(got[1], want[1], BF16_GRAD_TOL) and _close(got[2], want[2], BF16_GRAD_TOL)


def test_frozen_head_and_no_grad():
    h, w, y = _inputs()
    w.requires_grad_(False)
    loss = chunked_lm_loss(h, w, y, 3)
    loss.backward()
    ref_h = h.detach().requires_grad_()
    _plain(ref_h, w, y).backward()
    assert w.grad is None and torch.allclose(h.grad, ref_h.grad, rtol=FP32_RTOL, atol=1e-7)
    with torch.no_grad():
        assert torch.allclose(chunked_lm_loss(h, w, y, 4), _plain(h, w, y), rtol=FP32_RTOL)


def test_auto_chunks_make_pieces_the_size_of_the_hidden_states():
    assert auto_chunks(16384, 32000, 2048) == 16 and auto_chunks(4096, 128256, 4096) == 32
    assert auto_chunks(10, 50, 32) == 2 and auto_chunks(3, 10**6, 8) == 3


@pytest.mark.parametrize("tied", [False, True])
def test_model_loss_and_gradients_equal_the_plain_head(tied):
    x = torch.randint(0, 50, (2, 17), generator=torch.Generator().manual_seed(1))
    runs = []
    for chunks in (1, 3):
        model = small_model(torch.float32, tie_embeddings=tied)
        model.chunked_loss.chunks = chunks
        assert (model.head_weight() is None) == (chunks == 1)
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (l1, g1), (l3, g3) = runs
    assert torch.allclose(l3, l1, rtol=FP32_RTOL)
    for name, grad in g1.items():
        assert torch.allclose(g3[name], grad, rtol=1e-4, atol=1e-6), name


@pytest.mark.slow  # dynamo's first trace in a process: seconds
def test_compile_traces_the_chunked_loss_in_one_graph():
    h, w, y = _inputs()
    want = _grads(_plain, h, w, y)
    compiled = torch.compile(lambda h, w, y: chunked_lm_loss(h, w, y, 3), backend="aot_eager", fullgraph=True)
    for a, b in zip(_grads(compiled, h, w, y), want):
        assert torch.allclose(a, b, rtol=FP32_RTOL, atol=FP32_RTOL * b.abs().max().item())


def test_explicit_chunks_under_tensor_parallelism_are_refused():
    with pytest.raises(ConfigError, match="memory.loss_chunks=4 .* parallel.tp=2"):
        check_supported(make_config("memory.loss_chunks=4", "parallel.tp=2", "model.preset=tiny"))


FP8_GRADS = ("e5m2 output gradients (2 mantissa bits) turn the one-ulp bf16 differences of the head's input "
             "gradient into block-gradient differences of up to 12% of the largest entry (wk); the losses agree")


@pytest.mark.parametrize("sets, loss_tol, grad_tol", [
    (["lora.rank=2"], FP32_RTOL, 1e-4),  # frozen head: the adapters' gradients only
    (["memory.precision=bf16"], BF16_LOSS_RTOL, BF16_GRAD_TOL),
    pytest.param(["memory.precision=bf16", "memory.fp8=tensorwise", "memory.fp8_emulate=true"], BF16_LOSS_RTOL,
                 BF16_GRAD_TOL, marks=pytest.mark.xfail(strict=True, reason=FP8_GRADS)),
], ids=["lora", "bf16", "fp8"])
def test_chunked_loss_composes_with_lora_and_fp8(sets, loss_tol, grad_tol):
    """The model as training builds it (parallelize) with the chunked loss against the whole logits."""
    from teratrain.measure import build_engine, random_batch

    runs = []
    for chunks in (1, 3):
        cfg = make_config("model.preset=tiny", "model.n_layers=2", "model.seq_len=16", f"memory.loss_chunks={chunks}",
                          *sets)
        model, _ = build_engine(cfg)
        assert (model.head_weight() is None) == (chunks == 1)
        x, y = random_batch(cfg, 2)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.memory.precision == "bf16"):
            loss = model(x, y)
        loss.backward()
        runs.append((loss.detach().float(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (l1, g1), (l3, g3) = runs
    assert abs(l3 - l1) <= loss_tol * abs(l1) and g1 and g1.keys() == g3.keys()
    for name, grad in g1.items():
        assert _close(g3[name].float(), grad.float(), grad_tol), name


def test_the_gemms_see_a_vocabulary_padded_to_align_rows(monkeypatch):
    """V = 37 (as GPT-2's 50,257, not a multiple of ALIGN): the head GEMMs multiply 64 rows, the padded logits
    take no probability (loss and both gradients as F.cross_entropy's, fp32), and the weight's gradient keeps
    its 37 rows; an aligned vocabulary is multiplied as it is."""
    from teratrain.models import chunked_loss

    seen = []
    real = chunked_loss._logits
    monkeypatch.setattr(chunked_loss, "_logits", lambda h, w, vocab: seen.append(w.shape[0]) or real(h, w, vocab))
    for V in (37, 64):
        seen.clear()
        h, w, y = _inputs(V=V)
        want = _grads(_plain, h, w, y)
        got = _grads(lambda h, w, y: chunked_lm_loss(h, w, y, 3), h, w, y)
        assert set(seen) == {64} and got[2].shape == (V, 16)
        for a, b in zip(got, want):
            assert torch.allclose(a, b, rtol=FP32_RTOL, atol=FP32_RTOL * b.abs().max().item())


@pytest.mark.parametrize("tied", [False, True])
def test_the_whole_logits_head_trains_over_the_padded_vocabulary(monkeypatch, tied):
    """memory.loss_chunks=1 (the default): in training a 50-token head's GEMM makes 64 columns and hands on a
    view of the first 50, so the loss and every gradient are those of the unpadded head (fp32, rel. 1e-5)."""
    from teratrain.models import chunked_loss

    def run(align):
        monkeypatch.setattr(chunked_loss, "ALIGN", align)
        model = small_model(torch.float32, tie_embeddings=tied)
        x = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
        logits = model(x)
        assert logits.shape == (2, 16, 50) and logits.stride(1) == (64 if align == 64 else 50)
        model(x, x.roll(-1, 1)).backward()
        return [p.grad for p in model.parameters()]

    for a, b in zip(run(64), run(1)):
        assert torch.allclose(a, b, rtol=FP32_RTOL, atol=FP32_RTOL * b.abs().max().item())
