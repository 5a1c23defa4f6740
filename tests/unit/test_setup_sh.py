"""setup.sh says in one line what to do when it cannot set up: too old a Python, no CPU torch.

Run on a copy of the script with fake `python` and `pip` programs, so nothing is installed."""

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _setup(tmp_path: Path, python: Path) -> subprocess.CompletedProcess:
    shutil.copy(ROOT / "setup.sh", tmp_path / "setup.sh")
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "PYTHON": str(python), "HOME": str(tmp_path)}
    return subprocess.run(["bash", str(tmp_path / "setup.sh")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)


def _one_line(proc) -> str:
    assert proc.returncode == 1, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("setup.sh: "), proc.stderr
    return lines[0]


@pytest.mark.skipif(shutil.which("bash") is None, reason="setup.sh is a bash script")
def test_too_old_python_is_named_with_the_fix(tmp_path):
    old = _script(tmp_path / "bin" / "python3.8", 'case "$*" in *platform*) echo 3.8.10;; *) exit 1;; esac\n')
    line = _one_line(_setup(tmp_path, old))
    assert "Python >= 3.10" in line and "3.8.10" in line and "PYTHON=" in line
    assert not (tmp_path / ".venv").exists()


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("nvidia-smi") is not None,
                    reason="the CPU-torch branch runs on machines without an NVIDIA GPU")
def test_cpu_torch_that_cannot_be_installed_is_one_line(tmp_path):
    venv_bin = tmp_path / ".venv" / "bin"
    # a Python that passes the version check and makes a venv whose python has no torch and whose pip fails
    make_venv = (f'mkdir -p {venv_bin}\n'
                 f'printf "#!/bin/sh\\nexit 1\\n" > {venv_bin}/python; chmod +x {venv_bin}/python\n'
                 f'printf "#!/bin/sh\\necho no network >&2; exit 1\\n" > {venv_bin}/pip; chmod +x {venv_bin}/pip\n'
                 f'echo "PATH={venv_bin}:\\$PATH" > {venv_bin}/activate\n')
    python = _script(tmp_path / "bin" / "python3", f'case "$*" in *venv*) {make_venv};; *) exit 0;; esac\n')
    line = _one_line(_setup(tmp_path, python))
    assert "could not install the CPU build of torch" in line and "pip install torch" in line
    assert os.access(venv_bin / "python", os.X_OK)
