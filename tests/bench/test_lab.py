"""The network lab: shaped throughput between namespaces, cleanup after kills, the loopback fallback."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time

import pytest

from sylvie_comm.bench import lab as bl
from sylvie_comm.bench import labnet
from sylvie_comm.bench.lab import LAB_PREFIX, Lab, LabError
from tests.lab_marks import needs_lab

pytestmark = pytest.mark.multiprocess


# Rank 1 receives NBYTES from rank 0 and prints the rate it saw, from its first byte to its last.
THROUGHPUT = r"""
import os, socket, sys, time
rank, n, port = int(os.environ["RANK"]), int(sys.argv[1]), 5201
peer = sys.argv[2]
if rank == 1:
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((peer, port)); s.listen(1); c, _ = s.accept(); got, t0 = 0, None
    while got < n:
        b = c.recv(1 << 20)
        if not b: break
        t0 = t0 or time.perf_counter(); got += len(b)
    print(f"RATE {got * 8 / (time.perf_counter() - t0)} {got}")
else:
    deadline = time.time() + 10
    while True:
        try: s = socket.create_connection((peer, port)); break
        except OSError:
            if time.time() > deadline: raise
            time.sleep(0.02)
    buf, sent = bytes(1 << 20), 0
    while sent < n: s.sendall(buf); sent += len(buf)
    s.close()
"""

# Rank 1 connects to MASTER_ADDR:MASTER_PORT where rank 0 listens: the torch.distributed environment works.
RENDEZVOUS = r"""
import os, socket, time
rank, addr, port = int(os.environ["RANK"]), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
if rank == 0:
    s = socket.socket(); s.bind((addr, port)); s.listen(1); c, _ = s.accept(); print("GOT", c.recv(16).decode())
else:
    deadline = time.time() + 10
    while True:
        try: s = socket.create_connection((addr, port)); break
        except OSError:
            if time.time() > deadline: raise
            time.sleep(0.02)
    s.sendall(b"hello"); s.close()
print("ENV", addr, os.environ["WORLD_SIZE"], os.environ["OMP_NUM_THREADS"], os.environ.get("GLOO_SOCKET_IFNAME"))
"""


def _tc(ns: str, dev: str) -> str:
    return subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout


@needs_lab
@pytest.mark.parametrize(("link", "nbytes"), [("10mbit", 1 << 20), ("100mbit", 8 << 20), ("1gbit", 30 << 20)])
def test_shaped_link_carries_the_rate_asked_for(link, nbytes):
    lines: list[str] = []
    with Lab(2, link, echo=lines.append) as lab:
        assert lab.shaped and lines[0].startswith("lab: 2 workers in network namespaces")
        # Both ends of every link carry the token bucket: the worker's eth0 and the bridge's port.
        for i, ns in enumerate(lab.worker_namespaces):
            assert "tbf" in _tc(ns, "eth0") and "tbf" in _tc(lab.switch, f"p{i}")
        asked = bl.LINK_RATES_BPS[link]
        assert asked is not None
        rates = []
        # The 2 cores are shared: a receiver starved of CPU reads below the link's rate, so up to 3 tries;
        # none may exceed it (that would be a link not shaped).
        for _ in range(3):
            results = lab.run([sys.executable, "-c", THROUGHPUT, str(nbytes), lab.addresses[1]], timeout=30)
            rates.append(float(results[1].output.split("RATE ")[1].split()[0]))
            if abs(rates[-1] - asked) / asked < 0.2:
                break
    assert all(r < 1.2 * asked for r in rates), f"{link}: measured {[f'{r / 1e9:.3f}' for r in rates]} Gbit/s"
    assert abs(rates[-1] - asked) / asked < 0.2, f"{link}: measured {[f'{r / 1e9:.3f}' for r in rates]} Gbit/s"
    assert not [n for n in bl.namespaces() if n.startswith(lab.prefix)]


@needs_lab
def test_workers_use_the_distributed_environment_in_their_namespaces():
    with Lab(2, "none", echo=None) as lab:
        results = lab.run([sys.executable, "-c", RENDEZVOUS], timeout=30)
    assert "GOT hello" in results[0].output
    assert f"ENV {lab.addresses[0]} 2 1 eth0" in results[1].output


@needs_lab
def test_killed_worker_fails_the_run_and_the_lab_still_cleans_up(monkeypatch):
    monkeypatch.setattr(bl, "GRACE_SECONDS", 0.5)
    with pytest.raises(LabError, match=r"rank 0 failed \(exit -9\)") as info, Lab(2, "100mbit", echo=None) as lab:
        procs = [lab.spawn(r, [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"])
                 for r in range(2)]  # fmt: skip
        assert bl.namespaces(lab.prefix) == sorted([*lab.worker_namespaces, lab.switch])
        time.sleep(0.3)
        os.kill(procs[0].pid, signal.SIGKILL)
        lab.wait(timeout=20)
    assert "--- rank 1" in str(info.value)
    assert bl.namespaces(lab.prefix) == []
    assert all(p.poll() is not None for p in procs)


@needs_lab
def test_run_past_its_time_is_killed_with_the_output_tail():
    t0 = time.monotonic()
    with pytest.raises(LabError, match="ran past the 1 s limit") as info, Lab(2, "none", echo=None) as lab:
        lab.run([sys.executable, "-c", "import time; print('still here', flush=True); time.sleep(60)"], timeout=1)
    assert time.monotonic() - t0 < 15 and "still here" in str(info.value)
    assert bl.namespaces(lab.prefix) == []


@needs_lab
def test_cleanup_removes_the_leftovers_of_a_killed_owner():
    owner = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from sylvie_comm.bench.lab import Lab\n"
         "lab = Lab(2, '1gbit', echo=None); lab.open()\n"
         "p = lab.spawn(1, [sys.executable, '-c', 'import time; time.sleep(60)'])\n"
         "print(lab.prefix, p.pid, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert owner.stdout is not None
        prefix, worker = owner.stdout.readline().split()
        assert len(bl.namespaces(prefix)) == 3
        assert (labnet.NETNS_ETC / f"{prefix}1" / "hosts").exists()  # the worker's host name -> its eth0
        assert bl.cleanup(prefix) == []  # the owner is alive: its lab is not a leftover
    finally:
        owner.kill()
        owner.wait()
    assert len(bl.namespaces(prefix)) == 3  # SIGKILL left them behind
    assert {f"{prefix}{n}" for n in ("0", "1", "sw")} <= set(bl.cleanup())
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in out and not list(labnet.NETNS_ETC.glob(f"{prefix}*"))
    assert _gone(int(worker))  # the worker in the namespace went with it


@needs_lab
def test_cleanup_removes_hosts_files_whose_namespace_is_gone():
    dead = labnet.NETNS_ETC / f"{LAB_PREFIX}999999999-dead-0"  # no such owner pid
    dead.mkdir(parents=True)
    (dead / "hosts").write_text("10.231.0.1 host\n")
    bl.cleanup(f"{LAB_PREFIX}999999999-dead-")
    assert not dead.exists()


# An owner that builds a lab with the run id it is given, starts a worker in it and waits to be killed.
OWNER = (
    "import sys, time; from sylvie_comm.bench.lab import Lab\n"
    "lab = Lab(2, 'none', runid=sys.argv[1], echo=None); lab.open(); assert lab.shaped, lab.banner\n"
    "p = lab.spawn(1, [sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print(lab.prefix, p.pid, flush=True); time.sleep(60)"
)


@needs_lab
@pytest.mark.parametrize("head", ["mine", "999999999", "1"])
def test_cleanup_keeps_a_live_lab_with_its_own_run_id_and_removes_it_once_the_owner_is_gone(head, capsys):
    """However a lab is named: no pid in its name, a pid that does not run, a pid that runs (1) but is not its owner."""
    from sylvie_comm import cli

    runid = f"{head}-{secrets.token_hex(3)}"
    owner = subprocess.Popen([sys.executable, "-c", OWNER, runid], stdout=subprocess.PIPE, text=True)
    names = sorted(f"{LAB_PREFIX}{runid}-{n}" for n in ("0", "1", "sw"))
    try:
        assert owner.stdout is not None
        prefix, worker = owner.stdout.readline().split()
        assert prefix == f"{LAB_PREFIX}{runid}-" and bl.namespaces(prefix) == names
        assert cli.main(["bench", "--cleanup"]) == 0  # every lab's leftovers, as a user runs it
        out = capsys.readouterr().out
        assert bl.namespaces(prefix) == names, out  # the owner is alive: its lab is not a leftover
        assert (labnet.NETNS_ETC / f"{prefix}1" / "hosts").exists()
        assert f"{prefix}* (pid {owner.pid})" in out, out
        assert not _gone(int(worker), wait=0.2)
    finally:
        owner.kill()
        owner.wait()
    assert bl.namespaces(prefix) == names  # SIGKILL left them behind
    assert sorted(bl.cleanup(prefix)) == names
    assert bl.namespaces(prefix) == [] and not list(labnet.NETNS_ETC.glob(f"{prefix}*"))
    assert not (labnet.OWNERS_DIR / runid).exists()  # nor the record of who owned it
    assert _gone(int(worker))


@needs_lab
def test_a_second_lab_with_a_run_id_in_use_leaves_the_first_alone():
    runid = f"twice-{secrets.token_hex(3)}"
    with Lab(1, "none", runid=runid, echo=None) as first:
        assert first.shaped
        built = bl.namespaces(first.prefix)
        with (
            pytest.raises(LabError, match=rf"run id '{runid}' is in use by process {os.getpid()}"),
            Lab(1, "none", runid=runid, shaped=True, echo=None),
        ):
            pass
        lines: list[str] = []
        with Lab(1, "none", runid=runid, echo=lines.append) as second:
            assert not second.shaped and "in use by process" in lines[0]  # the loopback fallback, saying why
        assert bl.namespaces(first.prefix) == built == sorted([first.switch, *first.worker_namespaces])
        assert "hello" in first.run([sys.executable, "-c", "print('hello')"], timeout=30)[0].output
    assert bl.namespaces(first.prefix) == [] and not (labnet.OWNERS_DIR / runid).exists()


@needs_lab
def test_closing_a_lab_leaves_a_lab_whose_run_id_extends_its_own():
    base = f"nest-{secrets.token_hex(3)}"
    with Lab(1, "none", runid=f"{base}-x", echo=None) as inner:
        inner_names = bl.namespaces(inner.prefix)
        with Lab(1, "none", runid=base, echo=None) as outer:
            assert outer.shaped and inner.prefix.startswith(outer.prefix)
        assert bl.namespaces(outer.prefix) == inner_names == sorted([inner.switch, *inner.worker_namespaces])
    assert bl.namespaces(outer.prefix) == []


@needs_lab
def test_a_run_id_left_by_a_killed_owner_is_taken_over():
    runid = f"again-{secrets.token_hex(3)}"
    owner = subprocess.Popen([sys.executable, "-c", OWNER, runid], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        prefix, _ = owner.stdout.readline().split()
    finally:
        owner.kill()
        owner.wait()
    assert len(bl.namespaces(prefix)) == 3
    with Lab(1, "none", runid=runid, shaped=True, echo=None) as lab:  # the leftovers of the dead owner go first
        assert bl.namespaces(prefix) == sorted([lab.switch, *lab.worker_namespaces])
        assert bl.live_labs(prefix) == {runid: os.getpid()}
    assert bl.namespaces(prefix) == []


def test_an_owner_record_names_its_owner_only_while_that_very_process_runs(monkeypatch, tmp_path):
    monkeypatch.setattr(labnet, "OWNERS_DIR", tmp_path)
    me = os.getpid()
    (tmp_path / "a").write_text(labnet.owner_record())
    assert labnet.owner("a") == me
    started = labnet.start_time(me)
    assert started is not None and started.isdigit()
    (tmp_path / "b").write_text(f"{me} {int(started) + 1}\n")  # the pid, used again by a later process
    assert labnet.owner("b") is None
    (tmp_path / "c").write_text("garbage")
    assert labnet.owner("c") is None
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "d").write_text(f"{dead.pid} 1\n")
    assert labnet.owner("d") is None
    # No record (a lab of an older version): a leading pid, if any, is asked.
    assert labnet.owner(f"{me}-beef") == me and labnet.owner(f"{dead.pid}-beef") is None
    assert labnet.owner("byhand-1") is None
    assert labnet.runid_of(f"{LAB_PREFIX}a-b-sw") == "a-b" and labnet.runid_of(f"{LAB_PREFIX}a-b-12") == "a-b"


def test_hosts_file_names_this_host_at_the_workers_address_first():
    import socket

    text = labnet.hosts_file("10.231.7.3")
    first = text.splitlines()[0].split("#")[0].split()
    assert first[0] == "10.231.7.3" and socket.gethostname() in first
    assert not [ln for ln in text.splitlines()[1:] if socket.gethostname() in ln.split("#")[0].split()[1:]]


def _gone(pid: int, wait: float = 5.0) -> bool:
    """Whether ``pid`` has exited (a zombie nobody reaps counts as exited)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_fallback_runs_workers_on_loopback_and_says_so_first():
    lines: list[str] = []
    with Lab(2, "1gbit", shaped=False, echo=lines.append) as lab:
        assert not lab.shaped and lab.fallback_reason == "shaped=False was asked for"
        assert lab.addresses == ["127.0.0.1", "127.0.0.1"]
        results = lab.run([sys.executable, "-c", RENDEZVOUS], timeout=30)
    assert lines[0].startswith("lab: LOOPBACK FALLBACK, link not shaped")
    assert "GOT hello" in results[0].output and "ENV 127.0.0.1 2 1" in results[1].output


def test_bad_values_are_named():
    with pytest.raises(ValueError, match=r"unknown link '2gbit'; valid: 10mbit, 100mbit, 1gbit, 10gbit, none"):
        Lab(2, "2gbit")
    with pytest.raises(ValueError, match="workers must be a positive integer, got 0"):
        Lab(0, "none")
    with pytest.raises(ValueError, match=f"must start with '{LAB_PREFIX}'"):
        bl.cleanup("other-")


@needs_lab
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_the_owner_removes_the_lab_then_ends_it(sig):
    owner = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from sylvie_comm.bench.lab import Lab\n"
         "with Lab(2, '100mbit', echo=None) as lab:\n"
         "    p = lab.spawn(0, [sys.executable, '-c', 'import time; time.sleep(60)'])\n"
         "    print(lab.prefix, p.pid, flush=True); time.sleep(60)\n"
         "print('not reached')"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # As a shell starts a program in the foreground: SIGINT at its default, even where the test runner
        # was started in the background (which ignores SIGINT, and children inherit that).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        assert owner.stdout is not None
        prefix, worker = owner.stdout.readline().split()
        assert len(bl.namespaces(prefix)) == 3
        owner.send_signal(sig)
        out, err = owner.communicate(timeout=30)
    finally:
        owner.kill()
    assert "not reached" not in out
    if sig == signal.SIGINT:
        assert "KeyboardInterrupt" in err
    else:
        assert owner.returncode == -signal.SIGTERM
    assert bl.namespaces(prefix) == [] and _gone(int(worker))


def test_failing_netns_add_falls_back_to_loopback(monkeypatch, tmp_path):
    def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        if args[:3] == ("ip", "netns", "add"):
            raise LabError(f"lab: '{' '.join(args)}' failed (1): mount of /run/netns: Operation not permitted")
        return subprocess.CompletedProcess(list(args), 0, "", "")

    monkeypatch.setattr(labnet, "unavailable_reason", lambda: None)
    monkeypatch.setattr(labnet, "ip", ip)
    monkeypatch.setattr(labnet, "OWNERS_DIR", tmp_path / "owners")  # writable without root too
    lines: list[str] = []
    with Lab(2, "100mbit", echo=lines.append) as lab:
        assert not lab.shaped and "Operation not permitted" in (lab.fallback_reason or "")
    assert lines[0].startswith("lab: LOOPBACK FALLBACK") and "ip netns add" in lines[0]
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(LabError, match="Operation not permitted"), Lab(2, "100mbit", shaped=True, echo=None):
        pass
    assert signal.getsignal(signal.SIGTERM) is before  # a lab that failed to open left no handler behind
    assert [f.name for f in (tmp_path / "owners").iterdir()] == [".lock"]  # nor an owner record


def test_a_lab_that_cannot_record_its_owner_falls_back_to_loopback(monkeypatch, tmp_path):
    monkeypatch.setattr(labnet, "unavailable_reason", lambda: None)
    monkeypatch.setattr(labnet, "ip", lambda *args, check=True: pytest.fail(f"no namespace without a record: {args}"))
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(labnet, "OWNERS_DIR", tmp_path / "file" / "owners")  # cannot be a folder
    with Lab(1, "none", echo=None) as lab:
        assert not lab.shaped and f"cannot record this lab's owner in {tmp_path}" in (lab.fallback_reason or "")


def test_progress_ticks_write_one_dot_per_call_only_where_asked(tmp_path):
    from sylvie_comm.bench.lab import ProgressTicks

    path = tmp_path / "progress"
    mine, other = ProgressTicks(str(path), True), ProgressTicks(str(tmp_path / "unused"), False)
    for epoch in range(3):
        mine({"epoch": epoch})
        other()
    mine()
    assert path.read_text() == "...."
    assert not (tmp_path / "unused").exists()
    mine.close()
    mine.close()
    mine()  # after close: nothing, no error
    assert path.read_text() == "...."


def test_progress_bar_creates_the_file_and_follows_the_ticks_up_to_its_total(tmp_path):
    from sylvie_comm.bench.lab import ProgressBar, ProgressTicks

    path = tmp_path / "progress"
    bar = ProgressBar(path, 3, "test", "step")
    assert path.read_text() == ""  # there before any worker ticks
    ticks = ProgressTicks(str(path), True)
    with bar as poll:
        for _ in range(5):
            ticks()
            poll()
        assert bar._bar is not None and bar._bar.n == 3  # never past the total
    assert bar._bar is None
    ticks.close()
    with ProgressBar(tmp_path / "quiet", 3, "test", "step", enabled=False) as poll:
        poll()  # no bar: nothing to move
    assert (tmp_path / "quiet").exists()
