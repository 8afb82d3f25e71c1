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
ranks, waited for with a bound on run time), by one of three launchers:

* ``plain`` (default): ``argv`` itself in namespace i, with the ``torch.distributed``
  environment set (``MASTER_ADDR`` is worker 0's address, ``RANK=i``, ``GLOO_SOCKET_IFNAME=eth0``);
* ``torchrun``: in namespace i, ``torchrun --nnodes N --node-rank i --nproc-per-node 1
  --master-addr <worker 0> --master-port P argv...`` (:meth:`Lab.torchrun_command`): the command
  one runs on each of N machines, one static rendezvous at worker 0's address, rank i on node i;
* ``horovodrun``: in namespace 0 only, ``horovodrun --gloo -np N -H <addr0>:1,<addr1>:1,...
  --network-interface eth0 argv...`` (:meth:`Lab.horovodrun_command`), the command one runs on
  the first of N machines. horovodrun reaches the other hosts with ``ssh HOST 'command'``; the
  lab puts an ``ssh`` of its own first on horovodrun's PATH (:meth:`Lab.ssh_shim`) that runs the
  command in the namespace that holds HOST's address (``ip netns exec``), as sshd would on HOST.

Both launchers also start on the loopback fallback (``127.0.0.1``, interface ``lo``).

The namespaces go when the lab closes: on exit, on an error, on SIGINT/SIGTERM
(the handlers clean up, then hand the signal on). :func:`cleanup` removes what a
killed run left (every namespace named with :data:`LAB_PREFIX` whose owner
process is gone); it is ``sylvie-comm bench --cleanup``. A lab records its owner
(pid and start time) in ``OWNERS_DIR/<run id>`` before it creates a namespace, so
cleanup tells a live lab from a leftover whatever its run id, and two labs never
share one.

Without root, without ``ip``/``tc``, or where ``ip netns add`` fails, the lab
falls back to loopback (plain processes on 127.0.0.1, link not shaped) and says
so in its first line (:attr:`Lab.banner`); :attr:`Lab.shaped` tells which.

Example::

    with Lab(4, "1gbit") as lab:
        results = lab.run([sys.executable, "train.py"], timeout=600)
        results = lab.run([sys.executable, "train.py"], timeout=600, launcher="torchrun")
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import IO, Any

from sylvie_comm.bench import labnet
from sylvie_comm.bench.lablaunch import Launch
from sylvie_comm.bench.labnet import (
    LAB_PREFIX,
    LINK_RATES_BPS,
    LINKS,
    LabError,
    check_link,
    cleanup,
    describe_live_labs,
    live_labs,
    namespaces,
    unavailable_reason,
)
from sylvie_comm.bench.labproc import (
    LAUNCHERS,
    ProgressBar,
    ProgressTicks,
    WorkerResult,
    check_launcher,
    free_port,
    gather_ranks,
    horovodrun_executable,
    kill_tree,
    leave_worker,
    serve_worker,
    split_horovod_output,
    start_worker,
    tail,
    worker_cli,
)

MASTER_PORT = 29500  # free in a fresh namespace; the loopback fallback picks a free port instead
GRACE_SECONDS = 10.0  # how long the other ranks get to exit after one fails


class Lab(Launch):
    """N workers in network namespaces joined by a bridge, the link shaped in both directions.

    Args:
        workers: number of worker namespaces (ranks), at least 1.
        link: ``10mbit``, ``100mbit``, ``1gbit``, ``10gbit`` or ``none`` (namespaces, not shaped).
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
        self._claimed = ""  # the owner record this lab wrote (see _claim()), until close() removes it
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
        reason = "shaped=False was asked for" if self._want is False else labnet.unavailable_reason()
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
            self.master_port = free_port()
            self.banner = (
                f"lab: LOOPBACK FALLBACK, link not shaped ({reason}): {self.workers} workers as plain "
                f"processes on 127.0.0.1, link {self.link} not applied"
            )
        if self.echo is not None:
            self.echo(self.banner)

    def _netns_add(self, name: str) -> None:
        labnet.ip("ip", "netns", "add", name)
        self._created.append(name)

    def _own_namespaces(self) -> list[str]:
        """The namespaces named for this lab's run id (a worker count of another lab may differ)."""
        return [name for name in labnet.namespaces(self.prefix) if labnet.runid_of(name) == self.runid]

    def _claim(self) -> None:
        """Record this process as the owner of the run id (before any namespace exists), or LabError
        if a live process owns it. A run id whose owner is gone is taken over, its namespaces removed
        first."""
        record = labnet.OWNERS_DIR / self.runid
        mine = labnet.owner_record()
        try:
            with labnet.owners_lock(create=True):  # against another lab or a cleanup() deciding
                leftovers = self._own_namespaces()
                if record.exists() or leftovers:
                    owner = labnet.owner(self.runid)
                    if owner is not None:
                        raise LabError(
                            f"Lab: run id {self.runid!r} is in use by process {owner} (its lab's namespaces "
                            f"are {self.prefix}*); choose another runid"
                        )
                    for name in leftovers:
                        labnet.delete_namespace(name)
                # Written whole, then moved into place: a reader sees the record complete or not at all.
                tmp = labnet.OWNERS_DIR / f".{self.runid}.{os.getpid()}.{secrets.token_hex(4)}"
                try:
                    tmp.write_text(mine)
                    self._claimed = mine  # before the move: a close() interrupting it finds out from the record
                    os.replace(tmp, record)
                finally:
                    tmp.unlink(missing_ok=True)
        except OSError as exc:
            raise LabError(f"lab: cannot record this lab's owner in {labnet.OWNERS_DIR}: {exc}") from None

    def _owns_record(self) -> bool:
        """Whether the owner record of the run id is the one this lab wrote."""
        if not self._claimed:
            return False
        try:
            return (labnet.OWNERS_DIR / self.runid).read_text() == self._claimed
        except OSError:
            return False

    def _build(self) -> None:
        shape = LINKS[self.link]
        self._claim()
        self._netns_add(self.switch)
        labnet.ip("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        labnet.ip("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.worker_namespaces):
            port = f"p{i}"
            self._netns_add(ns)
            # Created inside the switch namespace, the worker end moved straight into its own:
            # no interface ever appears in the root namespace.
            labnet.ip("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            labnet.ip("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            labnet.ip("ip", "-n", self.switch, "link", "set", port, "up")
            labnet.ip("ip", "-n", ns, "addr", "add", f"10.231.{self.subnet}.{i + 1}/24", "dev", "eth0")
            with contextlib.suppress(OSError):  # best effort: only programs that resolve the host name need it
                (labnet.NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
                (labnet.NETNS_ETC / ns / "hosts").write_text(labnet.hosts_file(f"10.231.{self.subnet}.{i + 1}"))
            labnet.ip("ip", "-n", ns, "link", "set", "eth0", "up")
            labnet.ip("ip", "-n", ns, "link", "set", "lo", "up")
            if shape is not None:
                rate, burst = shape
                tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", labnet.TBF_LATENCY]
                labnet.ip("tc", "-n", ns, "qdisc", "add", "dev", "eth0", *tbf)  # worker -> switch
                labnet.ip("tc", "-n", self.switch, "qdisc", "add", "dev", port, *tbf)  # switch -> worker

    # ------------------------------------------------------------------ workers

    def spawn(
        self, rank: int, argv: Sequence[str], env: Mapping[str, str] | None = None, *, launcher: str = "plain"
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` as rank ``rank`` (in its namespace) by ``launcher`` (see :meth:`run`); its output
        goes to a log :meth:`output` reads."""
        if self._logdir is None or self._closed:
            raise LabError("Lab: spawn() needs an open lab (use it as a context manager)")
        old = self._procs.get(rank)
        if old is not None and old.poll() is None:
            raise LabError(f"Lab: rank {rank} is still running (pid {old.pid})")
        cmd, full_env = self.command(rank, argv, launcher), self.env(rank, env, launcher)
        log = open(Path(self._logdir.name) / f"rank{rank}.log", "w+b")  # noqa: SIM115  # closed in close()
        if rank in self._logs:
            self._logs[rank].close()
        self._logs[rank] = log
        # A session of its own: the lab kills the whole process group, and a Ctrl-C meant for
        # the parent reaches the workers through the parent's cleanup, once.
        proc = subprocess.Popen(
            cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
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
        launcher: str = "plain",
    ) -> list[WorkerResult]:
        """Start every rank and wait for all of them, at most ``timeout`` seconds.

        ``argv`` and ``env`` may be functions of the rank. ``poll`` is called a few times a
        second while waiting (a progress bar). Raises :class:`LabError` with the tail of
        every rank's output when one fails (the others get ``GRACE_SECONDS``, then are
        killed) or when the time is up (all are killed).

        ``launcher``: ``plain`` starts ``argv`` as each rank; ``torchrun`` starts
        :meth:`torchrun_command` in each namespace; ``horovodrun`` starts :meth:`horovodrun_command`
        in namespace 0 (``argv`` and ``env`` of rank 0), which starts every rank. With horovodrun
        each result holds that rank's lines of horovodrun's output (without the ``[i]<stdout>:``
        prefixes) and horovodrun's exit status; :meth:`output` (0) has the whole of it.
        """
        check_launcher(launcher)
        for rank in [r for r, p in self._procs.items() if p.poll() is not None]:
            del self._procs[rank]  # an earlier run's: this run waits for its own
        for rank in range(1 if launcher == "horovodrun" else self.workers):
            a = argv(rank) if callable(argv) else argv
            e = env(rank) if callable(env) else env
            self.spawn(rank, a, e, launcher=launcher)
        results = self.wait(timeout=timeout, poll=poll)
        if launcher != "horovodrun":
            return results
        code = results[0].returncode
        return [
            WorkerResult(r, code, out) for r, out in enumerate(split_horovod_output(results[0].output, self.workers))
        ]

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
            tails = "\n".join(f"--- rank {res.rank} (exit {res.returncode}):\n{tail(res.output)}" for res in results)
            raise LabError(f"lab ({self.link}, {self.workers} workers): {why}\n{tails}")
        return results

    def kill(self) -> None:
        """SIGKILL every process the lab started: their process groups, every process below them (torchrun's
        and horovodrun's workers run in sessions of their own) and, in the lab, whatever runs in its namespaces."""
        for proc in self._procs.values():
            if proc.poll() is None:
                kill_tree(proc.pid)
        if self.shaped:
            for name in self.worker_namespaces:
                labnet.kill_namespace_processes(name)
        for proc in self._procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

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
            labnet.delete_namespace(name)
        self._created = []
        if not self._owns_record():  # (a forced cleanup may have passed the run id on to another lab)
            self._claimed = ""
            return  # no namespace of this run id is this lab's (another lab's run id may extend this one's)
        for name in self._own_namespaces():  # a half-built namespace from an interrupted _build()
            labnet.delete_namespace(name)
        with contextlib.suppress(OSError):
            (labnet.OWNERS_DIR / self.runid).unlink()
        self._claimed = ""

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
    removed = labnet.cleanup()
    print(f"removed {len(removed)} lab namespace(s){': ' + ', '.join(removed) if removed else ''}")
    live = live_labs()
    if live:
        print(describe_live_labs(live))
    return 0


__all__ = [
    "GRACE_SECONDS",
    "LAB_PREFIX",
    "LAUNCHERS",
    "LINKS",
    "LINK_RATES_BPS",
    "MASTER_PORT",
    "Lab",
    "LabError",
    "ProgressBar",
    "ProgressTicks",
    "WorkerResult",
    "check_launcher",
    "check_link",
    "cleanup",
    "describe_live_labs",
    "gather_ranks",
    "horovodrun_executable",
    "leave_worker",
    "live_labs",
    "main",
    "namespaces",
    "serve_worker",
    "split_horovod_output",
    "start_worker",
    "unavailable_reason",
    "worker_cli",
]


if __name__ == "__main__":
    sys.exit(main())
