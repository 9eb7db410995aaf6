"""The flags a launch script hands `pretrain_difflm.py`, read without training.

The script runs with a stand-in `torchrun` first on PATH that records its arguments, so a test
can validate a script's flags (tests/unit_tests/test_launch_scripts.py) or run exactly the
quickstart's training in its own worker processes (tests/distributed/test_checkpoint_resume.py).
"""

import os
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def recorded_flags(script: str, tmp_path: Path, env: dict, *args: str, entry: str = "pretrain_difflm.py") -> list:
    """The arguments after `entry` of `bash script args` under `env` (added to os.environ)."""
    fake = tmp_path / "launch-bin"
    fake.mkdir(exist_ok=True)
    record = fake / "argv"
    (fake / "torchrun").write_text(f'#!/usr/bin/env bash\nprintf "%q " "$@" > {shlex.quote(str(record))}\n')
    (fake / "torchrun").chmod(0o755)
    # CHECK_ARGS=0: the caller validates the recorded flags itself (the scripts' own check is
    # test_launch_scripts.py's)
    env = dict(os.environ, CHECK_ARGS="0", **env, PATH=f"{fake}:{os.environ['PATH']}")
    subprocess.run(["bash", script, *args], cwd=ROOT, env=env, check=True, timeout=60)
    argv = shlex.split(record.read_text())
    return argv[argv.index(entry) + 1:]
