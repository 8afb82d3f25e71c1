"""Processes that trained with a hook exit cleanly: the hook's group and threads go on the right thread.

A future callback runs on the worker thread of the group its collective ran on, and holds the hook's
state. When it finishes after ``destroy_process_group()`` and after the script dropped the state, the
state goes on that thread; when the state owned the group, the group's destructor then joined the
thread it ran on: ``std::system_error: Resource deadlock avoided``, abort at exit, now and then.
``_late`` makes that order certain; ``_ends`` trains every hook and ends as training scripts do
(``state.close()`` then ``destroy_process_group()``, ``destroy_process_group()`` alone, or plain exit).

The processes are forked from one launcher that imported torch once (a fresh interpreter costs seconds
of CPU to import torch and the modules DDP loads lazily), and each leaves through the interpreter's own
exit (atexit handlers, then teardown), as a spawned process does.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from sylvie_comm.collectives import SerialExecutor
from tests.dist_utils import free_port
from tests.integrations import workloads as wl

pytestmark = pytest.mark.multiprocess

ENDINGS = ("close", "destroy", "exit")
RUNS = 15  # two processes each: 30 process exits per hook, 10 per ending
STEPS = 4  # two plain warm-up steps, two compressed ones
RUN_TIMEOUT_S = 60.0


def _trained_states(rank: int, world: int, port: int) -> list[Any]:
    """Every hook registered on a DDP model of its own and trained for ``STEPS`` steps."""
    import sylvie_comm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    states = []
    for hook in sorted(sylvie_comm.ddp.HOOKS):
        ddp = DDP(wl.mlp(), bucket_cap_mb=wl.TINY_BUCKET_MB)
        state = sylvie_comm.ddp.register(ddp, hook)
        wl.train_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05), rank, range(STEPS))
        states.append(state)
    return states


def _ends(rank: int, world: int, port: int, ending: str) -> None:
    """Train with every hook, then end as a training script does; the states live until the process ends."""
    states = _trained_states(rank, world, port)
    if ending == "close":
        for state in states:
            group, thread = weakref.ref(state.transport.group), getattr(state._executor, "_thread", None)
            state.close()
            if group() is not None or (thread is not None and thread.is_alive()):
                raise AssertionError(f"{state.name}: close() left its group or its thread alive")
    if ending in ("close", "destroy"):
        dist.destroy_process_group()


def _late(rank: int, world: int, port: int, ending: str) -> None:
    """A future callback holding a hook's state finishes after ``destroy_process_group()``, on the group's thread.

    The state then goes last on that thread: the group must not go with it (were the state the group's
    owner, the group's destructor would join the thread it runs on).
    """
    states = _trained_states(rank, world, port)
    finished = []

    def late(_: Any, state: Any) -> None:
        time.sleep(1.0)
        finished.append(state.name)

    groups = []
    for state in states:
        groups.append(weakref.ref(state.transport.group))
        state.transport.all_reduce(torch.ones(1)).then(functools.partial(late, state=state))
    del states, state
    dist.destroy_process_group()
    alive = [i for i, g in enumerate(groups) if g() is not None]
    if alive or len(finished) != len(groups):
        raise AssertionError(f"destroy_process_group() left groups {alive} alive; callbacks finished: {finished}")


def _launch(target: str, runs: int, world: int = 2) -> bool:
    """Fork ``world`` processes per run, each running ``target``; print each run's exit codes as a JSON line.

    Returns True in a forked process (which then leaves through the interpreter's exit), False in the
    launcher once every run is over.
    """
    import torch._dynamo  # noqa: F401  (DDP imports it lazily: once here, not in every process)

    import sylvie_comm  # noqa: F401

    if threading.active_count() != 1:
        raise RuntimeError(f"the launcher must not fork with threads running: {threading.enumerate()}")
    fn = {"ends": _ends, "late": _late}[target]
    for i in range(runs):
        ending, port = ENDINGS[i % len(ENDINGS)], free_port()
        pids = []
        for rank in range(world):
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                fn(rank, world, port, ending)
                return True
            pids.append(pid)
        codes: dict[int, int | str] = {}
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while len(codes) < world:
            for rank, pid in enumerate(pids):
                if rank not in codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[rank] = os.waitstatus_to_exitcode(status)
            if time.monotonic() > deadline:
                for rank, pid in enumerate(pids):
                    if rank not in codes:
                        os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)
                        codes[rank] = f"still running after {RUN_TIMEOUT_S:g} s"
            time.sleep(0.05)
        print(json.dumps({"run": i, "ending": ending, "codes": [codes[r] for r in range(world)]}), flush=True)
    return False


def _runs(target: str, runs: int) -> list[dict[str, Any]]:
    """The runs whose processes did not all exit with 0 (the launcher's stderr attached)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = f"from tests.integrations.test_shutdown import _launch; _launch({target!r}, {runs})"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=runs * RUN_TIMEOUT_S + 120)  # fmt: skip
    done = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and len(done) == runs, (proc.returncode, proc.stdout, proc.stderr[-5000:])
    return [{**r, "stderr": proc.stderr[-5000:]} for r in done if r["codes"] != [0, 0]]


def test_a_state_released_on_its_groups_thread_after_destroy_exits_cleanly():
    """Deterministic: every hook's state goes last in a callback on its group's thread, after destroy."""
    assert not _runs("late", 1)


@pytest.mark.quality
def test_every_process_exits_cleanly_after_training_with_every_hook():
    """15 runs of two processes, each training every hook: all 30 processes of every hook exit with 0."""
    assert not _runs("ends", RUNS)


def test_an_executor_thread_keeps_no_finished_job_and_stops_when_closed_or_dropped():
    class Held:
        pass

    executor = SerialExecutor("sylvie-comm-test")
    held = Held()
    ref = weakref.ref(held)
    assert executor.submit(lambda held=held: 7).wait() == 7
    del held
    deadline = time.monotonic() + 5.0
    while ref() is not None and time.monotonic() < deadline:  # the thread lets go of the job once it ran
        time.sleep(0.01)
    assert ref() is None, "the idle executor thread still holds its last job"
    thread = executor._thread
    executor.close()
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="'sylvie-comm-test' is closed"):
        executor.submit(lambda: 0)
    executor.close()  # idempotent

    dropped = SerialExecutor("sylvie-comm-dropped")
    thread = dropped._thread
    del dropped
    thread.join(5.0)
    assert not thread.is_alive(), "a dropped executor's thread kept running"
