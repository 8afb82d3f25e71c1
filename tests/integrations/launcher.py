"""Run a framework's launcher (``accelerate launch``, a script whose Lightning Trainer starts the other ranks) from
a test: a session of its own, killed whole on a timeout, so a hang fails the test instead of hanging it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

# Set by a launcher around pytest; a child would join that run instead of starting its own.
_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "PL_GLOBAL_SEED")


def launch(cmd: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None) -> str:
    """Run ``cmd`` in a session of its own; kill the whole session (the launcher's children too) on a timeout."""
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV and not k.startswith("KINETO_")}
    base.update(OMP_NUM_THREADS="1", **(env or {}))
    proc = subprocess.Popen(cmd, cwd=cwd, env=base, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"{cmd[1:3]} did not finish within {timeout}s:\n{output[-4000:]}") from None
    finally:
        with contextlib.suppress(ProcessLookupError):  # a rank the launcher left behind
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{output[-6000:]}"
    return output
