"""A network lab: N workers in network namespaces joined by a shaped link.

Compression pays only where the network is the bottleneck, and a laptop's or a
CI machine's loopback never is. :class:`Lab` builds, for one run, what a small
cluster's network looks like, on one Linux host and without touching the host's
own network::

    namespace sclab-<pid>-<id>-sw    bridge br0, ports p0 .. p{N-1}  (the "switch")
    namespace sclab-<pid>-<id>-<i>   lo, eth0 = 10.231.<k>.<i+1>/24  (worker i)

Each worker's ``eth0`` is one end of a veth pair whose other end (``p<i>``) is a
port of the bridge. The link is shaped with a token bucket (``tc qdisc ... tbf``)
on the egress of both ends, so a worker sends and receives at the rate asked for
(``netem`` is not used: it is often not built). Every address lives inside the
namespaces the lab creates; the root namespace gets nothing.

Workers are started with :meth:`Lab.spawn` (one rank) or :meth:`Lab.run` (all
ranks, waited for with a bound on run time) with the ``torch.distributed``
environment set (``MASTER_ADDR`` is worker 0's address, ``GLOO_SOCKET_IFNAME=eth0``).

The namespaces go when the lab closes: on exit, on an error, on SIGINT/SIGTERM
(the handlers clean up, then hand the signal on). :func:`cleanup` removes what a
killed run left (every namespace named with :data:`LAB_PREFIX` whose owner
process is gone); it is ``sylvie-comm bench --cleanup``.

Without root, without ``ip``/``tc``, or where ``ip netns add`` fails, the lab
falls back to loopback (plain processes on 127.0.0.1, link not shaped) and says
so in its first line (:attr:`Lab.banner`); :attr:`Lab.shaped` tells which.

Example::

    with Lab(4, "1gbit") as lab:
        results = lab.run([sys.executable, "train.py"], timeout=600)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any

LAB_PREFIX = "sclab-"

# Link name -> (tbf rate, tbf burst); None: not shaped. The burst holds a few
# milliseconds of traffic at the rate (at least rate / HZ, or tbf cannot reach
# the rate), the latency bounds the queue.
LINKS: dict[str, tuple[str, str] | None] = {
    "100mbit": ("100mbit", "128kb"),
    "1gbit": ("1gbit", "1mb"),
    "10gbit": ("10gbit", "8mb"),
    "none": None,
}
LINK_RATES_BPS: dict[str, float | None] = {"100mbit": 100e6, "1gbit": 1e9, "10gbit": 10e9, "none": None}
TBF_LATENCY = "50ms"
MASTER_PORT = 29500  # free in a fresh namespace; the loopback fallback picks a free port instead
GRACE_SECONDS = 10.0  # how long the other ranks get to exit after one fails
_IP_TIMEOUT = 20.0  # seconds one ip/tc command may take


class LabError(RuntimeError):
    """The lab could not be built, or its workers failed or ran past their time."""


@dataclass
class WorkerResult:
    """How one worker ended: its rank, exit status and whole output (stdout and stderr together)."""

    rank: int
    returncode: int
    output: str


def check_link(link: str) -> str:
    """``link`` if it names a link; ValueError listing the valid names otherwise."""
    if link not in LINKS:
        raise ValueError(f"unknown link {link!r}; valid: {', '.join(LINKS)}")
    return link


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = list(args)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_IP_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        raise LabError(f"lab: '{' '.join(cmd)}' did not finish in {_IP_TIMEOUT:.0f} s") from None
    if check and proc.returncode != 0:
        raise LabError(f"lab: '{' '.join(cmd)}' failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def namespaces(prefix: str = LAB_PREFIX) -> list[str]:
    """Names of the network namespaces that start with ``prefix`` (empty without ``ip``)."""
    if shutil.which("ip") is None:
        return []
    proc = _ip("ip", "netns", "list", check=False)
    names = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(prefix))


def _kill_namespace_processes(name: str) -> None:
    """SIGKILL whatever still runs in namespace ``name`` (processes a lab started there)."""
    proc = _ip("ip", "netns", "pids", name, check=False)
    for pid in proc.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
            os.kill(int(pid), signal.SIGKILL)


def _delete_namespace(name: str) -> bool:
    """Kill the processes in namespace ``name`` and delete it (its veths and bridge go with it)."""
    _kill_namespace_processes(name)
    return _ip("ip", "netns", "del", name, check=False).returncode == 0


def _owner_alive(name: str) -> bool:
    """Whether the process that built namespace ``name`` still runs (its pid leads the run id)."""
    head = name[len(LAB_PREFIX) :].split("-", 1)[0]
    if not head.isdigit():
        return False  # a run id given by hand: no owner to ask
    try:
        os.kill(int(head), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup(prefix: str = LAB_PREFIX, *, force: bool = False) -> list[str]:
    """Remove what labs left behind: network namespaces named ``prefix...``, and what runs in them.

    A lab's namespaces are named ``sclab-<owner pid>-<random>-...``; those whose owner still
    runs are kept unless ``force`` (a live lab removes its own on exit). Deleting a namespace
    deletes the veth ends and the bridge inside it. Returns the names removed.
    """
    if not prefix.startswith(LAB_PREFIX):
        raise ValueError(f"cleanup: prefix {prefix!r} must start with {LAB_PREFIX!r} (only labs' namespaces go)")
    return [name for name in namespaces(prefix) if (force or not _owner_alive(name)) and _delete_namespace(name)]


def unavailable_reason() -> str | None:
    """Why namespaces cannot be built here (no root, no ``ip``/``tc``), or None if they may be."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "not root (network namespaces need CAP_NET_ADMIN)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (install iproute2)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


class Lab:
    """N workers in network namespaces joined by a bridge, the link shaped in both directions.

    Args:
        workers: number of worker namespaces (ranks), at least 1.
        link: ``100mbit``, ``1gbit``, ``10gbit`` or ``none`` (namespaces, not shaped).
        shaped: None (default): namespaces where possible, loopback otherwise; False: loopback
            (plain processes on 127.0.0.1); True: namespaces or :class:`LabError`.
        runid: names the run's namespaces (``sclab-<runid>-<i>``); default: ``<pid>-<random>``.
        echo: where the banner (the first line: lab or loopback fallback, and why) goes;
            default: stdout. None: nowhere.
        handle_signals: clean up on SIGINT/SIGTERM, then hand the signal on (main thread only).

    Attributes:
        shaped: whether the workers run in the lab's namespaces (False: loopback fallback).
        fallback_reason: why the lab fell back to loopback, or None.
        addresses: each worker's address (all ``127.0.0.1`` on loopback).
        banner: one line saying what was built.
    """

    def __init__(
        self,
        workers: int,
        link: str,
        *,
        shaped: bool | None = None,
        runid: str | None = None,
        echo: Callable[[str], None] | None = print,
        handle_signals: bool = True,
    ) -> None:
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"Lab: workers must be a positive integer, got {workers!r}")
        self.link = check_link(link)
        self.workers = workers
        self.runid = runid or f"{os.getpid()}-{secrets.token_hex(2)}"  # the owner's pid: see cleanup()
        if not self.runid.replace("-", "").isalnum():
            raise ValueError(f"Lab: runid must be letters, digits and '-', got {self.runid!r}")
        self.prefix = f"{LAB_PREFIX}{self.runid}-"
        self.switch = f"{self.prefix}sw"
        self.worker_namespaces = [f"{self.prefix}{i}" for i in range(workers)]
        # A /24 per run (10.231.<k>.0/24): only inside this run's namespaces, so runs never meet.
        self.subnet = zlib.crc32(self.runid.encode()) % 256
        self._want = shaped
        self.echo = echo
        self.handle_signals = handle_signals
        self.shaped = False
        self.fallback_reason: str | None = None
        self.addresses: list[str] = []
        self.master_port = MASTER_PORT
        self.banner = ""
        self._created: list[str] = []
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._logs: dict[int, IO[bytes]] = {}
        self._old_handlers: dict[int, Any] = {}
        self._closed = False
        self._logdir: tempfile.TemporaryDirectory[str] | None = None

    # ------------------------------------------------------------------ building

    def __enter__(self) -> Lab:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        """Build the namespaces (or fall back to loopback) and print the banner."""
        if self._closed or self._logdir is not None:
            raise LabError("Lab: open() once per lab")
        self._logdir = tempfile.TemporaryDirectory(prefix=f"{self.prefix}log-")
        self._install_signal_handlers()
        try:
            self._open()
        except BaseException:
            self.close()  # the handlers, the logs and whatever was half built
            raise

    def _open(self) -> None:
        reason = "shaped=False was asked for" if self._want is False else unavailable_reason()
        if reason is None:
            try:
                self._build()
            except LabError as exc:
                self._remove_namespaces()
                if self._want is True:
                    raise
                reason = str(exc)
        elif self._want is True:
            raise LabError(f"Lab(shaped=True): network namespaces are not available: {reason}")
        if reason is None:
            self.shaped = True
            self.addresses = [f"10.231.{self.subnet}.{i + 1}" for i in range(self.workers)]
            self.master_port = MASTER_PORT
            rate = "not shaped" if LINKS[self.link] is None else f"tbf {self.link} each way"
            self.banner = (
                f"lab: {self.workers} workers in network namespaces {self.prefix}0..{self.workers - 1} "
                f"(10.231.{self.subnet}.0/24, bridge in {self.switch}), link {self.link} ({rate})"
            )
        else:
            self.shaped = False
            self.fallback_reason = reason
            self.addresses = ["127.0.0.1"] * self.workers
            self.master_port = _free_port()
            self.banner = (
                f"lab: LOOPBACK FALLBACK, link not shaped ({reason}): {self.workers} workers as plain "
                f"processes on 127.0.0.1, link {self.link} not applied"
            )
        if self.echo is not None:
            self.echo(self.banner)

    def _netns_add(self, name: str) -> None:
        _ip("ip", "netns", "add", name)
        self._created.append(name)

    def _build(self) -> None:
        shape = LINKS[self.link]
        self._netns_add(self.switch)
        _ip("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.worker_namespaces):
            port = f"p{i}"
            self._netns_add(ns)
            # Created inside the switch namespace, the worker end moved straight into its own:
            # no interface ever appears in the root namespace.
            _ip("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            _ip("ip", "-n", self.switch, "link", "set", port, "up")
            _ip("ip", "-n", ns, "addr", "add", f"10.231.{self.subnet}.{i + 1}/24", "dev", "eth0")
            _ip("ip", "-n", ns, "link", "set", "eth0", "up")
            _ip("ip", "-n", ns, "link", "set", "lo", "up")
            if shape is not None:
                rate, burst = shape
                tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", TBF_LATENCY]
                _ip("tc", "-n", ns, "qdisc", "add", "dev", "eth0", *tbf)  # worker -> switch
                _ip("tc", "-n", self.switch, "qdisc", "add", "dev", port, *tbf)  # switch -> worker

    # ------------------------------------------------------------------ workers

    def env(self, rank: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of rank ``rank``: ``os.environ``, ``env``, then the torch.distributed variables."""
        self._check_rank(rank)
        out = dict(os.environ)
        out.update(env or {})
        out.update(
            MASTER_ADDR=self.addresses[0],
            MASTER_PORT=str(self.master_port),
            RANK=str(rank),
            WORLD_SIZE=str(self.workers),
            LOCAL_RANK=str(rank),
            OMP_NUM_THREADS="1",
            SYLVIE_LAB_LINK=self.link,
            SYLVIE_LAB_SHAPED="1" if self.shaped else "0",
        )
        if self.shaped:
            out["GLOO_SOCKET_IFNAME"] = "eth0"
        elif Path("/sys/class/net/lo").exists():
            out["GLOO_SOCKET_IFNAME"] = "lo"  # loopback: not whatever the host name resolves to
        else:
            out.pop("GLOO_SOCKET_IFNAME", None)
        return out

    def command(self, rank: int, argv: Sequence[str]) -> list[str]:
        """``argv`` as run in rank ``rank``'s namespace (unchanged on loopback)."""
        self._check_rank(rank)
        if not argv:
            raise ValueError("Lab: empty command")
        if self.shaped:
            return ["ip", "netns", "exec", self.worker_namespaces[rank], *argv]
        return list(argv)

    def spawn(self, rank: int, argv: Sequence[str], env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` as rank ``rank`` (in its namespace); its output goes to a log :meth:`output` reads."""
        if self._logdir is None or self._closed:
            raise LabError("Lab: spawn() needs an open lab (use it as a context manager)")
        old = self._procs.get(rank)
        if old is not None and old.poll() is None:
            raise LabError(f"Lab: rank {rank} is still running (pid {old.pid})")
        log = open(Path(self._logdir.name) / f"rank{rank}.log", "w+b")  # noqa: SIM115  # closed in close()
        if rank in self._logs:
            self._logs[rank].close()
        self._logs[rank] = log
        # A session of its own: the lab kills the whole process group, and a Ctrl-C meant for
        # the parent reaches the workers through the parent's cleanup, once.
        proc = subprocess.Popen(
            self.command(rank, argv), env=self.env(rank, env), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self._procs[rank] = proc
        return proc

    def output(self, rank: int) -> str:
        """Everything rank ``rank`` has written so far (stdout and stderr)."""
        log = self._logs.get(rank)
        if log is None:
            return ""
        return Path(log.name).read_bytes().decode(errors="replace")

    def run(
        self,
        argv: Sequence[str] | Callable[[int], Sequence[str]],
        env: Mapping[str, str] | Callable[[int], Mapping[str, str]] | None = None,
        *,
        timeout: float = 600.0,
        poll: Callable[[], None] | None = None,
    ) -> list[WorkerResult]:
        """Start every rank and wait for all of them, at most ``timeout`` seconds.

        ``argv`` and ``env`` may be functions of the rank. ``poll`` is called a few times a
        second while waiting (a progress bar). Raises :class:`LabError` with the tail of
        every rank's output when one fails (the others get ``GRACE_SECONDS``, then are
        killed) or when the time is up (all are killed).
        """
        for rank in range(self.workers):
            a = argv(rank) if callable(argv) else argv
            e = env(rank) if callable(env) else env
            self.spawn(rank, a, e)
        return self.wait(timeout=timeout, poll=poll)

    def wait(self, *, timeout: float = 600.0, poll: Callable[[], None] | None = None) -> list[WorkerResult]:
        """Wait for every spawned rank (see :meth:`run`)."""
        deadline = time.monotonic() + timeout
        failed_at: float | None = None
        why = ""
        while True:
            codes = {r: p.poll() for r, p in self._procs.items()}
            if poll is not None:
                poll()
            if all(c is not None for c in codes.values()):
                break
            now = time.monotonic()
            bad = [r for r, c in codes.items() if c not in (None, 0)]
            if bad and failed_at is None:
                failed_at = now
            if failed_at is not None and now - failed_at > GRACE_SECONDS:
                why = f"rank {bad[0]} failed (exit {codes[bad[0]]}); killed the ranks still running"
                break
            if now > deadline:
                why = f"ran past the {timeout:.0f} s limit; killed every rank"
                break
            time.sleep(0.2)
        if why:
            self.kill()
        results = [WorkerResult(r, int(p.wait()), self.output(r)) for r, p in sorted(self._procs.items())]
        if not why:
            failed = [res for res in results if res.returncode != 0]
            if failed:
                why = f"rank {failed[0].rank} failed (exit {failed[0].returncode})"
        if why:
            tails = "\n".join(f"--- rank {res.rank} (exit {res.returncode}):\n{_tail(res.output)}" for res in results)
            raise LabError(f"lab ({self.link}, {self.workers} workers): {why}\n{tails}")
        return results

    def kill(self) -> None:
        """SIGKILL every process the lab started (their whole process groups)."""
        for proc in self._procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in self._procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.workers:
            raise ValueError(f"Lab: rank {rank} out of range for {self.workers} workers")

    # ------------------------------------------------------------------ cleaning up

    def close(self) -> None:
        """Kill the workers, remove the namespaces and the logs, restore the signal handlers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.kill()
            self._remove_namespaces()
        finally:
            for log in self._logs.values():
                log.close()
            if self._logdir is not None:
                self._logdir.cleanup()
            self._restore_signal_handlers()

    def _remove_namespaces(self) -> None:
        # The workers first: deleting a worker namespace deletes its eth0 and the peer port on the bridge.
        for name in reversed(self._created):
            _delete_namespace(name)
        self._created = []
        if self._want is False:
            return
        for name in namespaces(self.prefix):  # a half-built namespace from an interrupted _build()
            _delete_namespace(name)

    def _install_signal_handlers(self) -> None:
        if not self.handle_signals:
            return
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler)
        self._old_handlers = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        previous = self._old_handlers.get(signum, signal.SIG_DFL)
        self.close()  # restores the previous handlers
        if callable(previous):
            previous(signum, frame)  # SIGINT's default raises KeyboardInterrupt
        elif previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sylvie_comm.bench.lab --cleanup``: remove leftover lab namespaces."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args != ["--cleanup"]:
        print("usage: python -m sylvie_comm.bench.lab --cleanup", file=sys.stderr)
        return 2
    removed = cleanup()
    print(f"removed {len(removed)} lab namespace(s){': ' + ', '.join(removed) if removed else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
