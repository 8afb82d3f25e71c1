"""The lab's network: network namespaces, the shaped link's settings, and the owner records of live labs.

What :class:`~sylvie_comm.bench.lab.Lab` builds and :func:`cleanup` removes: namespaces named
``sclab-<run id>-<sw or i>`` (:data:`LAB_PREFIX`), each lab's owner (pid and start time) recorded in
``OWNERS_DIR/<run id>`` before its first namespace, and the hosts file ``ip netns exec`` shows each
worker (:func:`hosts_file`). Every ``ip``/``tc`` command goes through :func:`ip`, bounded in time.
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
from collections.abc import Iterator, Mapping
from pathlib import Path

LAB_PREFIX = "sclab-"

# Link name -> (tbf rate, tbf burst); None: not shaped. The burst holds a few
# milliseconds of traffic at the rate (at least rate / HZ, or tbf cannot reach
# the rate), the latency bounds the queue.
LINKS: dict[str, tuple[str, str] | None] = {
    "10mbit": ("10mbit", "32kb"),
    "100mbit": ("100mbit", "128kb"),
    "1gbit": ("1gbit", "1mb"),
    "10gbit": ("10gbit", "8mb"),
    "none": None,
}
LINK_RATES_BPS: dict[str, float | None] = {"10mbit": 10e6, "100mbit": 100e6, "1gbit": 1e9, "10gbit": 10e9, "none": None}
TBF_LATENCY = "50ms"
_IP_TIMEOUT = 20.0  # seconds one ip/tc command may take
NETNS_ETC = Path("/etc/netns")  # ip netns exec NS bind-mounts /etc/netns/NS/<file> over /etc/<file>
# One file per lab, named by its run id: "<owner pid> <its start time> <random>", written before its first namespace.
# On /run (a tmpfs, like /run/netns where the namespaces live): both go at a reboot.
OWNERS_DIR = Path("/run/sylvie-comm-labs")


class LabError(RuntimeError):
    """The lab could not be built, or its workers failed or ran past their time."""


def check_link(link: str) -> str:
    """``link`` if it names a link; ValueError listing the valid names otherwise."""
    if link not in LINKS:
        raise ValueError(f"unknown link {link!r}; valid: {', '.join(LINKS)}")
    return link


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
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
    proc = ip("ip", "netns", "list", check=False)
    names = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(prefix))


def kill_namespace_processes(name: str) -> None:
    """SIGKILL whatever still runs in namespace ``name`` (processes a lab started there)."""
    proc = ip("ip", "netns", "pids", name, check=False)
    for pid in proc.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
            os.kill(int(pid), signal.SIGKILL)


def delete_namespace(name: str) -> bool:
    """Kill the processes in namespace ``name`` and delete it (its veths and bridge go with it) and its
    ``/etc/netns/<name>`` (the hosts file ``ip netns exec`` shows there)."""
    kill_namespace_processes(name)
    deleted = ip("ip", "netns", "del", name, check=False).returncode == 0
    shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
    return deleted


def hosts_file(address: str) -> str:
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


def runid_of(name: str) -> str:
    """The run id of lab namespace (or hosts folder) ``name``: ``sclab-<run id>-<sw or worker index>``."""
    return name[len(LAB_PREFIX) :].rsplit("-", 1)[0]


def start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks after boot, from /proc), or None if it is gone (or a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return fields[19]  # field 22 of proc(5); fields[0] is field 3


def owner_record() -> str:
    """What a lab of this process writes as its owner: ``<pid> <start time> <random>`` (the last part tells
    two labs of one process apart)."""
    pid = os.getpid()
    return f"{pid} {start_time(pid) or '-'} {secrets.token_hex(4)}\n"


def owner(runid: str) -> int | None:
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
    started = start_time(pid)
    if started is None or (parts[1] != "-" and started != parts[1]):
        return None
    return pid


@contextlib.contextmanager
def owners_lock(*, create: bool) -> Iterator[None]:
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
    for runid in sorted({runid_of(name) for name in namespaces(prefix)}):
        pid = owner(runid)
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
            owners[runid] = owner(runid)
        return force or owners[runid] is None

    def chosen(runid: str) -> bool:
        return f"{LAB_PREFIX}{runid}-".startswith(prefix)

    with owners_lock(create=False):
        removed = [name for name in namespaces(prefix) if gone(runid_of(name)) and delete_namespace(name)]
        left = {runid_of(name) for name in namespaces(prefix)}
        with contextlib.suppress(OSError):  # hosts files of namespaces already gone
            for folder in NETNS_ETC.glob(f"{prefix}*"):
                if gone(runid_of(folder.name)) and runid_of(folder.name) not in left:
                    shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):  # owner records of labs that are gone
            for record in OWNERS_DIR.iterdir():
                if not record.name.startswith("."):
                    if chosen(record.name) and record.name not in left and gone(record.name):
                        record.unlink(missing_ok=True)
                    continue
                parts = record.name.split(".")  # ".<run id>.<pid>.<random>": a record its writer died writing
                if len(parts) == 4 and chosen(parts[1]) and parts[2].isdigit() and start_time(int(parts[2])) is None:
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
