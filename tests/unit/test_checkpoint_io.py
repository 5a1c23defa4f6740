"""Checkpoint files: streamed safetensors that the reference reader accepts, atomic step folders,
fallback past a corrupt newest checkpoint, pruning."""

import json

import pytest
import torch
from safetensors.torch import load_file

from teratrain.checkpoint.io import CheckpointError, candidates, find_valid, load_rank, save, write_safetensors
from tests.helpers import flip_byte, truncate


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(24, generator=g)
    return {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(4, 7, generator=g).to(torch.bfloat16),
        "f16": torch.randn(9, generator=g).to(torch.float16),
        "f64": torch.randn(2, 2, generator=g, dtype=torch.float64),
        "i64": torch.arange(-5, 6),
        "i32": torch.arange(7, dtype=torch.int32),
        "u8": torch.arange(256, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "transposed": torch.randn(3, 4, generator=g).T,  # not contiguous
        "view.a": flat[:10].view(2, 5),  # views of one flat buffer (save_file would refuse these)
        "view.b": flat[10:].view(7, 2),
    }


def test_write_safetensors_is_read_back_by_the_reference_reader(tmp_path):
    tensors = sample_tensors()
    write_safetensors(tmp_path / "x.safetensors", tensors)
    back = load_file(tmp_path / "x.safetensors")
    assert back.keys() == tensors.keys()
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape, k
        assert torch.equal(back[k], t), k


def test_header_is_8_byte_aligned(tmp_path):
    write_safetensors(tmp_path / "x.safetensors", {"odd_name_len_x": torch.ones(1)})
    header_len = int.from_bytes((tmp_path / "x.safetensors").read_bytes()[:8], "little")
    assert header_len % 8 == 0


def save_step(root, step, keep=10, value=None):
    tensors = {"w": torch.full((4, 4), float(step if value is None else value)),
               "bf": torch.ones(3, dtype=torch.bfloat16)}
    return save(root, step, rank=0, world=1, tensors=tensors, meta={"step": step, "note": "x"}, keep=keep,
                global_meta={"config": {"k": 1}})


@pytest.fixture
def three_steps(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        save_step(root, step)
    return root


def test_save_and_load_round_trip(three_steps):
    path, meta = find_valid(three_steps)
    assert path.name == "step_00000003" and meta["step"] == 3 and meta["config"] == {"k": 1}
    assert (three_steps / "latest").read_text() == "step_00000003"
    tensors, rank_meta = load_rank(path, 0)
    assert torch.equal(tensors["w"], torch.full((4, 4), 3.0)) and tensors["bf"].dtype == torch.bfloat16
    assert rank_meta == {"step": 3, "note": "x"}


@pytest.mark.parametrize("corrupt", ["truncate", "flip_tensor_byte", "flip_json_byte", "delete_meta"])
def test_find_valid_skips_a_corrupt_newest_checkpoint(three_steps, corrupt, capsys):
    newest = three_steps / "step_00000003"
    if corrupt == "truncate":
        truncate(newest / "rank00000.safetensors")
    elif corrupt == "flip_tensor_byte":
        flip_byte(newest / "rank00000.safetensors")
    elif corrupt == "flip_json_byte":
        flip_byte(newest / "rank00000.json", offset=2)
    else:
        (newest / "meta.json").unlink()
    path, meta = find_valid(three_steps)
    assert path.name == "step_00000002" and meta["step"] == 2
    warning = capsys.readouterr().err
    assert warning.startswith("teratrain: warning:") and "step_00000003" in warning and "step_00000002" in warning


def test_all_corrupt_is_a_checkpoint_error(three_steps):
    for step in (1, 2, 3):
        flip_byte(three_steps / f"step_{step:08d}" / "rank00000.safetensors")
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        find_valid(three_steps)


def test_no_checkpoints_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        find_valid(tmp_path / "missing")


def test_tmp_folders_are_ignored(three_steps):
    """A crash mid-save leaves step_X.tmp/, which must never be loaded even if it looks newer."""
    partial = three_steps / "step_00000009.tmp"
    partial.mkdir()
    (partial / "meta.json").write_text(json.dumps({"step": 9, "files": {}}))
    assert partial not in candidates(three_steps)
    assert find_valid(three_steps)[0].name == "step_00000003"


def test_a_crashed_save_of_the_same_step_is_replaced(three_steps):
    (three_steps / "step_00000004.tmp").mkdir()
    (three_steps / "step_00000004.tmp" / "junk").write_text("x")
    save_step(three_steps, 4)
    assert not (three_steps / "step_00000004.tmp").exists()
    assert sorted(p.name for p in (three_steps / "step_00000004").iterdir()) == ["meta.json", "rank00000.json",
                                                                                  "rank00000.safetensors"]


def test_saving_a_step_again_replaces_it(three_steps):
    save_step(three_steps, 3, value=7.0)
    tensors, _ = load_rank(find_valid(three_steps)[0], 0)
    assert torch.equal(tensors["w"], torch.full((4, 4), 7.0))


def test_keep_prunes_the_oldest(tmp_path):
    root = tmp_path / "checkpoints"
    for step in range(1, 6):
        save_step(root, step, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000004", "step_00000005"]


def test_saving_an_older_step_keeps_it(tmp_path):
    """After a fallback (newest checkpoint corrupt, resumed from an older one) the run saves steps below
    the abandoned newest. Pruning must never delete the checkpoint just written and named by `latest`."""
    root = tmp_path / "checkpoints"
    save_step(root, 2, keep=2)
    save_step(root, 4, keep=2)
    flip_byte(root / "step_00000004" / "rank00000.safetensors")  # the newest went bad; resume from 2
    save_step(root, 3, keep=1)
    assert (root / "latest").read_text() == "step_00000003"
    assert (root / "step_00000003").is_dir()
    assert find_valid(root)[0].name == "step_00000003"


def test_latest_pointer_is_tried_first(three_steps):
    (three_steps / "latest").write_text("step_00000002")
    assert candidates(three_steps)[0].name == "step_00000002"
    assert find_valid(three_steps)[0].name == "step_00000002"


def test_a_full_disk_names_the_intact_checkpoint_only_when_there_is_one(tmp_path, monkeypatch):
    import errno

    from teratrain.checkpoint import io

    root = tmp_path / "run" / "checkpoints"

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(io, "write_safetensors", full)
        with pytest.raises(CheckpointError) as first:
            save(root, 2, 0, 1, sample_tensors(), {"step": 2}, keep=2)
    line = str(first.value)
    assert "No space left" in line and "intact" not in line and "no earlier checkpoint" in line
    assert f"delete {root.parent}" in line and not list(root.glob("*.tmp"))

    save(root, 2, 0, 1, sample_tensors(), {"step": 2}, keep=2)
    monkeypatch.setattr(io, "write_safetensors", full)
    with pytest.raises(CheckpointError, match=r"--resume: the last complete checkpoint \(step_00000002\) is intact"):
        save(root, 4, 0, 1, sample_tensors(), {"step": 4}, keep=2)
