"""memory.fp8 through the CLI on CPU (torchao's emulation): the summary says what runs in float8, the
loss falls, and a checkpoint holds no float8 tensor, so a run resumes bf16 -> fp8 -> bf16."""

import pytest

from teratrain import compat

from tests.integration.runner import checkpoint_tensors, metrics

try:  # torchao is the optional `fp8` extra; setup.sh installs it
    compat.torchao_float8()
except ImportError:
    pytest.skip("torchao is not installed", allow_module_level=True)
pytestmark = pytest.mark.slow

EMULATED = ["memory.fp8=tensorwise", "memory.fp8_emulate=true"]


def test_resumes_across_bf16_and_fp8(cli, tmp_path):
    out = tmp_path / "run"
    cli.train(out, "memory.precision=bf16", "checkpoint.every=2", steps=2)
    bf16 = checkpoint_tensors(out)
    proc = cli.train(out, *EMULATED, steps=4, resume=True)
    assert "teratrain: fp8: 14 block linears in float8 (tensorwise scales, torchao)" in proc.stderr
    assert "memory.fp8: 'none' -> 'tensorwise'" in proc.stderr
    fp8 = checkpoint_tensors(out)
    assert fp8.keys() == bf16.keys() and {t.dtype for t in fp8.values()} == {t.dtype for t in bf16.values()}
    proc = cli.train(out, "memory.fp8=none", "memory.fp8_emulate=false", steps=6, resume=True)
    assert "teratrain: fp8:" not in proc.stderr
    losses = [r["loss"] for r in metrics(out)]
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4, 5, 6]
    assert losses[-1] < losses[0]
