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
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any, NoReturn

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
LAUNCHERS = ("plain", "torchrun", "horovodrun")
# Set by the lab for a plain rank; torchrun and horovodrun set what their workers need themselves.
_DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
              "GROUP_RANK", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
              "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME", "HOROVOD_GLOO_RENDEZVOUS_ADDR",
              "HOROVOD_GLOO_RENDEZVOUS_PORT")  # fmt: skip
_HVD_LINE = re.compile(r"^\[(\d+)\]<(?:stdout|stderr)>:(.*)$")
_IP_TIMEOUT = 20.0  # seconds one ip/tc command may take
NETNS_ETC = Path("/etc/netns")  # ip netns exec NS bind-mounts /etc/netns/NS/<file> over /etc/<file>
# One file per lab, named by its run id: "<owner pid> <its start time> <random>", written before its first namespace.
# On /run (a tmpfs, like /run/netns where the namespaces live): both go at a reboot.
OWNERS_DIR = Path("/run/sylvie-comm-labs")


class ProgressTicks:
    """A worker's ticks into the lab's progress file, one per finished step or epoch (only the worker
    given ``write`` writes; the others' ticks do nothing). Called with any arguments; ``close()`` once."""

    def __init__(self, path: str, write: bool) -> None:
        self._file = open(path, "a") if write else None  # noqa: SIM115 (closed by close())

    def __call__(self, *_: object) -> None:
        if self._file is not None:
            self._file.write(".")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def leave_worker(code: int = 0) -> NoReturn:
    """End a lab worker process now, without the interpreter's teardown (its results written, its groups closed).

    About one exit in 10-20 of a worker that trained with gloo aborted in ``Py_Finalize``
    ("terminate called without an active exception", SIGABRT): a gloo worker thread still alive
    there released a finished collective's work holding a Python tensor and needed the GIL that
    finalization no longer hands out. The launchers (torchrun's agent, the lab) report a worker
    that aborts as a failed run, after every figure was measured and written. Workers call this
    last, after ``destroy_process_group()`` and after flushing what they wrote.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
    """Kill the processes in namespace ``name`` and delete it (its veths and bridge go with it) and its
    ``/etc/netns/<name>`` (the hosts file ``ip netns exec`` shows there)."""
    _kill_namespace_processes(name)
    deleted = _ip("ip", "netns", "del", name, check=False).returncode == 0
    shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
    return deleted


def _hosts_file(address: str) -> str:
    """An ``/etc/hosts`` for a worker whose host name resolves to its own ``eth0`` address.

    Every namespace shares the host's name (one UTS namespace), which ``/etc/hosts`` usually maps to a
    loopback address (127.0.0.1, or 127.0.1.1 on Debian). Programs that find their address from
    their host name would then tell their peers 127.0.0.1: Horovod 0.28's gloo process-set contexts
    do (``GlooContext::InitializeForProcessSet`` creates its device without the interface,
    ignoring ``HOROVOD_GLOO_IFACE``), and ``hvd.init()`` aborts with ``connect [127.0.0.1]:PORT:
    Connection refused``. A machine whose host name resolves to its network address is what they
    expect; ``ip netns exec`` shows ``/etc/netns/<ns>/hosts`` as ``/etc/hosts``.
    """
    name = socket.gethostname()
    names = {name, name.split(".")[0]}
    try:
        lines = Path("/etc/hosts").read_text().splitlines()
    except OSError:
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
    kept = [ln for ln in lines if not names & set(ln.split("#", 1)[0].split()[1:])]
    head = f"{address} {' '.join(sorted(names, key=len, reverse=True))}  # sylvie_comm lab: this worker's eth0"
    return "\n".join([head, *kept]) + "\n"


def _runid(name: str) -> str:
    """The run id of lab namespace (or hosts folder) ``name``: ``sclab-<run id>-<sw or worker index>``."""
    return name[len(LAB_PREFIX) :].rsplit("-", 1)[0]


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks after boot, from /proc), or None if it is gone (or a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return fields[19]  # field 22 of proc(5); fields[0] is field 3


def _owner_record() -> str:
    """What a lab of this process writes as its owner: ``<pid> <start time> <random>`` (the last part tells
    two labs of one process apart)."""
    pid = os.getpid()
    return f"{pid} {_start_time(pid) or '-'} {secrets.token_hex(4)}\n"


def _owner(runid: str) -> int | None:
    """The pid of the live process that owns lab ``runid``, or None if it is gone (-1: a record that
    cannot be read, kept as if its owner ran).

    From the lab's record in :data:`OWNERS_DIR`: the pid must run and have started when the record
    says (a pid used again by another process is not the owner). A record that cannot be parsed
    names no owner. Without a record (a lab of an older sylvie_comm, which had none) the pid that
    leads the default run id ``<pid>-<random>`` is asked; such a run id given by hand names none.
    """
    try:
        text = (OWNERS_DIR / runid).read_text()
    except FileNotFoundError:
        head = runid.split("-", 1)[0]
        if not head.isdigit():
            return None
        try:
            os.kill(int(head), 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return int(head)
    except OSError:
        return -1  # there is a record and it cannot be read: not known to be gone, so kept
    parts = text.split()
    if len(parts) < 2 or not parts[0].isdigit():
        return None
    pid = int(parts[0])
    started = _start_time(pid)
    if started is None or (parts[1] != "-" and started != parts[1]):
        return None
    return pid


@contextlib.contextmanager
def _owners_lock(*, create: bool) -> Iterator[None]:
    """Hold ``OWNERS_DIR/.lock``: a lab claiming a run id and a cleanup deciding which labs are gone take
    turns. ``create``: make the folder, and fail with OSError where the lock cannot be had (a lab must
    record its owner); otherwise go on without it (a cleanup without root deletes nothing anyway)."""
    import fcntl

    fd = -1
    try:
        if create:
            OWNERS_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
        fd = os.open(OWNERS_DIR / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        if create:
            raise
    try:
        if fd >= 0:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd >= 0:
            os.close(fd)


def live_labs(prefix: str = LAB_PREFIX) -> dict[str, int]:
    """Run id -> owner pid of every lab with namespaces named ``prefix...`` whose owner still runs."""
    out: dict[str, int] = {}
    for runid in sorted({_runid(name) for name in namespaces(prefix)}):
        pid = _owner(runid)
        if pid is not None:
            out[runid] = pid
    return out


def describe_live_labs(live: Mapping[str, int]) -> str:
    """One line naming the labs :func:`cleanup` kept (``live``: :func:`live_labs`) and their owners."""
    owners = ", ".join(f"{LAB_PREFIX}{runid}-* (pid {pid if pid > 0 else 'unknown'})" for runid, pid in live.items())
    return f"kept {len(live)} lab(s) whose owner still runs: {owners}"


def cleanup(prefix: str = LAB_PREFIX, *, force: bool = False) -> list[str]:
    """Remove what labs left behind: network namespaces named ``prefix...``, and what runs in them.

    A lab's namespaces are named ``sclab-<run id>-<sw or i>``, and the lab records its owner
    (pid and start time) under :data:`OWNERS_DIR` before it creates them; the namespaces of a lab
    whose owner still runs are kept unless ``force`` (a live lab removes its own on exit), however
    its run id was chosen. Deleting a namespace deletes the veth ends and the bridge inside it;
    the lab's hosts files and owner record go once its namespaces have. Returns the names removed.
    """
    if not prefix.startswith(LAB_PREFIX):
        raise ValueError(f"cleanup: prefix {prefix!r} must start with {LAB_PREFIX!r} (only labs' namespaces go)")
    owners: dict[str, int | None] = {}

    def gone(runid: str) -> bool:
        if runid not in owners:
            owners[runid] = _owner(runid)
        return force or owners[runid] is None

    def chosen(runid: str) -> bool:
        return f"{LAB_PREFIX}{runid}-".startswith(prefix)

    with _owners_lock(create=False):
        removed = [name for name in namespaces(prefix) if gone(_runid(name)) and _delete_namespace(name)]
        left = {_runid(name) for name in namespaces(prefix)}
        with contextlib.suppress(OSError):  # hosts files of namespaces already gone
            for folder in NETNS_ETC.glob(f"{prefix}*"):
                if gone(_runid(folder.name)) and _runid(folder.name) not in left:
                    shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):  # owner records of labs that are gone
            for record in OWNERS_DIR.iterdir():
                if not record.name.startswith("."):
                    if chosen(record.name) and record.name not in left and gone(record.name):
                        record.unlink(missing_ok=True)
                    continue
                parts = record.name.split(".")  # ".<run id>.<pid>.<random>": a record its writer died writing
                if len(parts) == 4 and chosen(parts[1]) and parts[2].isdigit() and _start_time(int(parts[2])) is None:
                    record.unlink(missing_ok=True)
    return removed


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


def check_launcher(launcher: str) -> str:
    """``launcher`` if it names one of :data:`LAUNCHERS`; ValueError listing them otherwise."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"unknown launcher {launcher!r}; valid: {', '.join(LAUNCHERS)}")
    return launcher


def _process_tree(root: int) -> list[int]:
    """``root`` and every process below it (from /proc; launchers start their workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _kill_tree(root: int) -> None:
    """SIGKILL ``root``'s process group and every process below it, with their groups."""
    for pid in _process_tree(root):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # a group leader's group (torchrun's and horovodrun's workers lead theirs)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def split_horovod_output(text: str, workers: int) -> list[str]:
    """horovodrun's output (lines ``[rank]<stdout>:...``) as each rank's own lines."""
    out: list[list[str]] = [[] for _ in range(workers)]
    for line in text.splitlines():
        m = _HVD_LINE.match(line)
        if m and int(m.group(1)) < workers:
            out[int(m.group(1))].append(m.group(2))
    return ["\n".join(lines) + ("\n" if lines else "") for lines in out]


def horovodrun_executable() -> str | None:
    """The ``horovodrun`` beside this Python (a virtual environment's), else the one on PATH; None without Horovod."""
    beside = Path(sys.executable).parent / "horovodrun"
    if beside.exists():
        return str(beside)
    return shutil.which("horovodrun")


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

    def _own_namespaces(self) -> list[str]:
        """The namespaces named for this lab's run id (a worker count of another lab may differ)."""
        return [name for name in namespaces(self.prefix) if _runid(name) == self.runid]

    def _claim(self) -> None:
        """Record this process as the owner of the run id (before any namespace exists), or LabError
        if a live process owns it. A run id whose owner is gone is taken over, its namespaces removed
        first."""
        record = OWNERS_DIR / self.runid
        mine = _owner_record()
        try:
            with _owners_lock(create=True):  # against another lab or a cleanup() deciding about this run id
                leftovers = self._own_namespaces()
                if record.exists() or leftovers:
                    owner = _owner(self.runid)
                    if owner is not None:
                        raise LabError(
                            f"Lab: run id {self.runid!r} is in use by process {owner} (its lab's namespaces "
                            f"are {self.prefix}*); choose another runid"
                        )
                    for name in leftovers:
                        _delete_namespace(name)
                # Written whole, then moved into place: a reader sees the record complete or not at all.
                tmp = OWNERS_DIR / f".{self.runid}.{os.getpid()}.{secrets.token_hex(4)}"
                try:
                    tmp.write_text(mine)
                    self._claimed = mine  # before the move: a close() interrupting it finds out from the record
                    os.replace(tmp, record)
                finally:
                    tmp.unlink(missing_ok=True)
        except OSError as exc:
            raise LabError(f"lab: cannot record this lab's owner in {OWNERS_DIR}: {exc}") from None

    def _owns_record(self) -> bool:
        """Whether the owner record of the run id is the one this lab wrote."""
        if not self._claimed:
            return False
        try:
            return (OWNERS_DIR / self.runid).read_text() == self._claimed
        except OSError:
            return False

    def _build(self) -> None:
        shape = LINKS[self.link]
        self._claim()
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
            with contextlib.suppress(OSError):  # best effort: only programs that resolve the host name need it
                (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
                (NETNS_ETC / ns / "hosts").write_text(_hosts_file(f"10.231.{self.subnet}.{i + 1}"))
            _ip("ip", "-n", ns, "link", "set", "eth0", "up")
            _ip("ip", "-n", ns, "link", "set", "lo", "up")
            if shape is not None:
                rate, burst = shape
                tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", TBF_LATENCY]
                _ip("tc", "-n", ns, "qdisc", "add", "dev", "eth0", *tbf)  # worker -> switch
                _ip("tc", "-n", self.switch, "qdisc", "add", "dev", port, *tbf)  # switch -> worker

    # ------------------------------------------------------------------ workers

    def env(self, rank: int, env: Mapping[str, str] | None = None, launcher: str = "plain") -> dict[str, str]:
        """The environment of rank ``rank``: ``os.environ``, ``env``, then the lab's variables.

        ``plain``: the torch.distributed variables (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
        ``WORLD_SIZE``, ``LOCAL_RANK``). ``torchrun`` and ``horovodrun``: none of those (the
        launcher sets its workers' own; any inherited ones are dropped), and for horovodrun the
        lab's ``ssh`` first on ``PATH``. All: ``OMP_NUM_THREADS=1``, ``GLOO_SOCKET_IFNAME``
        (``eth0``; ``lo`` on loopback) and ``SYLVIE_LAB_LINK``/``SYLVIE_LAB_SHAPED``.
        """
        self._check_rank(rank)
        check_launcher(launcher)
        out = dict(os.environ)
        out.update(env or {})
        if launcher == "plain":
            out.update(MASTER_ADDR=self.addresses[0], MASTER_PORT=str(self.master_port), RANK=str(rank),
                       WORLD_SIZE=str(self.workers), LOCAL_RANK=str(rank))  # fmt: skip
        else:
            for key in _DIST_VARS:
                out.pop(key, None)
        if launcher == "horovodrun" and self.shaped:
            out["PATH"] = os.pathsep.join([str(self.ssh_shim().parent), out.get("PATH", os.defpath)])
        out.update(OMP_NUM_THREADS="1", SYLVIE_LAB_LINK=self.link, SYLVIE_LAB_SHAPED="1" if self.shaped else "0")
        if self.shaped:
            out["GLOO_SOCKET_IFNAME"] = "eth0"
        elif Path("/sys/class/net/lo").exists():
            out["GLOO_SOCKET_IFNAME"] = "lo"  # loopback: not whatever the host name resolves to
        else:
            out.pop("GLOO_SOCKET_IFNAME", None)
        return out

    @property
    def interface(self) -> str:
        """The workers' network interface: ``eth0`` in the lab, ``lo`` on loopback."""
        return "eth0" if self.shaped else "lo"

    def torchrun_command(self, rank: int, argv: Sequence[str]) -> list[str]:
        """torchrun on node ``rank`` of N, one process per node, static rendezvous at worker 0's address.

        ``argv`` is ``[sys.executable, script.py, args...]`` or ``[sys.executable, -m, module, args...]``
        (torchrun runs it with this Python), or any other command (run with ``--no-python``). The
        ``torchrun`` is ``sys.executable -m torch.distributed.run``, the same program.
        """
        self._check_rank(rank)
        argv = list(argv)
        if not argv:
            raise ValueError("Lab: empty command")
        python = argv[0] == sys.executable and len(argv) > 1 and argv[1] != "-c"
        script = argv[1:] if python else ["--no-python", *argv]
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.workers), "--node-rank",
                str(rank), "--nproc-per-node", "1", "--master-addr", self.addresses[0], "--master-port",
                str(self.master_port), *script]  # fmt: skip

    def horovodrun_command(self, argv: Sequence[str]) -> list[str]:
        """horovodrun over every worker, one slot each, gloo on the workers' interface (run in namespace 0)."""
        if not argv:
            raise ValueError("Lab: empty command")
        exe = horovodrun_executable()
        if exe is None:
            raise LabError("Lab: horovodrun not found (pip install horovod with gloo)")
        hosts = ",".join(f"{a}:1" for a in self.addresses) if self.shaped else f"127.0.0.1:{self.workers}"
        # --disable-cache: horovodrun would otherwise remember under ~/.horovod that these addresses answered ssh.
        return [exe, "--gloo", "-np", str(self.workers), "-H", hosts, "--network-interface", self.interface,
                "--disable-cache", *argv]  # fmt: skip

    def ssh_shim(self) -> Path:
        """The lab's ``ssh`` (written once per lab): ``ssh [options] HOST COMMAND`` runs COMMAND with
        ``/bin/sh -c`` in the namespace holding HOST's address, as sshd on HOST would; other hosts fail
        (exit 255, as ssh does)."""
        if self._logdir is None or not self.shaped:
            raise LabError("Lab: the ssh shim needs an open lab with namespaces")
        path = Path(self._logdir.name) / "bin" / "ssh"
        if path.exists():
            return path
        cases = "\n".join(f"  {a}) ns={shlex.quote(ns)} ;;" for a, ns in zip(self.addresses, self.worker_namespaces,
                                                                           strict=True))  # fmt: skip
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"""#!/bin/sh
# sylvie_comm lab: "ssh [options] HOST COMMAND" runs COMMAND in the network namespace of HOST
# (options may come before and after HOST, as horovodrun puts them: ssh -o A=b HOST -o C=d true)
host=
while [ $# -gt 0 ]; do
  case "$1" in
    -[BbcDEeFIiJLlmOoPpQRSWw]) shift 2 ;;
    -*) shift ;;
    *) [ -z "$host" ] || break; host=${{1#*@}}; shift ;;
  esac
done
[ -n "$host" ] || {{ echo "lab ssh: no host" >&2; exit 255; }}
case "$host" in
{cases}
  *) echo "lab ssh: $host is not a worker of this lab" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" /bin/sh -c "$*"
""")
        path.chmod(0o755)
        return path

    def command(self, rank: int, argv: Sequence[str], launcher: str = "plain") -> list[str]:
        """``argv`` as started for rank ``rank`` by ``launcher``, in its namespace (none on loopback)."""
        self._check_rank(rank)
        check_launcher(launcher)
        if not argv:
            raise ValueError("Lab: empty command")
        if launcher == "torchrun":
            argv = self.torchrun_command(rank, argv)
        elif launcher == "horovodrun":
            if rank != 0:
                raise ValueError("Lab: horovodrun starts from worker 0 only (it starts every rank)")
            argv = self.horovodrun_command(argv)
        if self.shaped:
            return ["ip", "netns", "exec", self.worker_namespaces[rank], *argv]
        return list(argv)

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
            tails = "\n".join(f"--- rank {res.rank} (exit {res.returncode}):\n{_tail(res.output)}" for res in results)
            raise LabError(f"lab ({self.link}, {self.workers} workers): {why}\n{tails}")
        return results

    def kill(self) -> None:
        """SIGKILL every process the lab started: their process groups, every process below them (torchrun's
        and horovodrun's workers run in sessions of their own) and, in the lab, whatever runs in its namespaces."""
        for proc in self._procs.values():
            if proc.poll() is None:
                _kill_tree(proc.pid)
        if self.shaped:
            for name in self.worker_namespaces:
                _kill_namespace_processes(name)
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
        if not self._owns_record():  # (a forced cleanup may have passed the run id on to another lab)
            self._claimed = ""
            return  # no namespace of this run id is this lab's (another lab's run id may extend this one's)
        for name in self._own_namespaces():  # a half-built namespace from an interrupted _build()
            _delete_namespace(name)
        with contextlib.suppress(OSError):
            (OWNERS_DIR / self.runid).unlink()
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
    removed = cleanup()
    print(f"removed {len(removed)} lab namespace(s){': ' + ', '.join(removed) if removed else ''}")
    live = live_labs()
    if live:
        print(describe_live_labs(live))
    return 0


if __name__ == "__main__":
    sys.exit(main())
