"""The lab's launchers: torchrun (one node per namespace) and horovodrun (from worker 0, over the lab's ssh)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from sylvie_comm.bench import horovod as bh
from sylvie_comm.bench import lab as bl
from sylvie_comm.bench import labnet
from sylvie_comm.bench.lab import Lab, LabError
from tests.lab_marks import lab_skip, needs_lab

pytestmark = [pytest.mark.multiprocess, pytest.mark.lab]  # the lab's launchers, shaped where root

needs_horovod = pytest.mark.skipif(bh.available() is not None, reason=f"no Horovod here: {bh.available()}")

# What a rank sees: the rank its launcher gave it, the address of its eth0, its network namespace and environment.
WHOAMI = r"""
import os, socket, subprocess
addr = subprocess.run(["ip", "-4", "-o", "addr", "show", "eth0"], capture_output=True, text=True).stdout.split()
print("WHO", os.environ.get("RANK"), os.environ.get("WORLD_SIZE"), os.environ.get("MASTER_ADDR"),
      addr[3].split("/")[0] if len(addr) > 3 else "-", os.stat("/proc/self/ns/net").st_ino,
      os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("OMP_NUM_THREADS"),
      "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "-",
      socket.gethostbyname(socket.gethostname()), flush=True)
"""

# A Horovod allreduce: each rank adds rank + 1; every rank must see 1 + 2 = 3.
HVD_ALLREDUCE = r"""
import os, subprocess, torch
import horovod.torch as hvd
hvd.init()
total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum)
addr = subprocess.run(["ip", "-4", "-o", "addr", "show", "eth0"], capture_output=True, text=True).stdout.split()
print("HVD", hvd.rank(), hvd.size(), addr[3].split("/")[0] if len(addr) > 3 else "-",
      os.stat("/proc/self/ns/net").st_ino, float(total), os.environ.get("HOROVOD_GLOO_IFACE"), flush=True)
hvd.shutdown()
"""


def _who(output: str) -> list[str]:
    return next(line for line in output.splitlines() if line.startswith("WHO ")).split()[1:]


def _netns_inode(name: str) -> int:
    return os.stat(f"/run/netns/{name}").st_ino


@needs_lab
def test_torchrun_starts_rank_i_in_namespace_i_with_its_address(tmp_path):
    script = tmp_path / "who.py"
    script.write_text(WHOAMI)
    with Lab(2, "none", echo=None) as lab:
        cmd = lab.command(1, [sys.executable, str(script)], "torchrun")
        results = lab.run([sys.executable, str(script)], timeout=60, launcher="torchrun")
        inodes = [_netns_inode(ns) for ns in lab.worker_namespaces]
    assert cmd[:4] == ["ip", "netns", "exec", lab.worker_namespaces[1]]
    assert cmd[4:] == [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", "1",
                       "--nproc-per-node", "1", "--master-addr", lab.addresses[0], "--master-port",
                       str(lab.master_port), str(script)]  # fmt: skip
    for i, res in enumerate(results):
        rank, world, master, addr, inode, iface, omp, launcher, resolved = _who(res.output)
        assert (rank, world, master, addr) == (str(i), "2", lab.addresses[0], lab.addresses[i])
        assert int(inode) == inodes[i] and (iface, omp, launcher) == ("eth0", "1", "torchrun")
        assert resolved == lab.addresses[i]  # the host name resolves to this worker's eth0, not 127.0.0.1
    assert bl.namespaces(lab.prefix) == [] and not list(labnet.NETNS_ETC.glob(f"{lab.prefix}*"))


def test_torchrun_on_the_loopback_fallback(tmp_path):
    script = tmp_path / "who.py"
    script.write_text(WHOAMI)
    with Lab(2, "1gbit", shaped=False, echo=None) as lab:
        results = lab.run([sys.executable, str(script)], timeout=60, launcher="torchrun")
    for i, res in enumerate(results):
        rank, world, master, _addr, _inode, iface, omp, launcher, _ = _who(res.output)
        assert (rank, world, master, iface, omp, launcher) == (str(i), "2", "127.0.0.1", "lo", "1", "torchrun")


@needs_lab
@needs_horovod
def test_horovodrun_from_worker_0_runs_an_allreduce_with_each_rank_in_its_namespace(tmp_path):
    script = tmp_path / "hvd.py"
    script.write_text(HVD_ALLREDUCE)
    with Lab(2, "1gbit", echo=None) as lab:
        cmd = lab.command(0, [sys.executable, str(script)], "horovodrun")
        results = lab.run([sys.executable, str(script)], timeout=90, launcher="horovodrun")
        inodes = [_netns_inode(ns) for ns in lab.worker_namespaces]
        hosts = f"{lab.addresses[0]}:1,{lab.addresses[1]}:1"
    assert cmd[:4] == ["ip", "netns", "exec", lab.worker_namespaces[0]]
    assert cmd[5:] == ["--gloo", "-np", "2", "-H", hosts, "--network-interface", "eth0", "--disable-cache",
                       sys.executable, str(script)]  # fmt: skip
    for i, res in enumerate(results):
        line = next(ln for ln in res.output.splitlines() if ln.startswith("HVD "))
        rank, size, addr, inode, total, iface = line.split()[1:]
        assert (rank, size, addr, float(total), iface) == (str(i), "2", lab.addresses[i], 3.0, "eth0")
        assert int(inode) == inodes[i]
    assert bl.namespaces(lab.prefix) == []


@needs_horovod
def test_horovodrun_on_the_loopback_fallback(tmp_path):
    script = tmp_path / "hvd.py"
    script.write_text(HVD_ALLREDUCE)
    with Lab(2, "1gbit", shaped=False, echo=None) as lab:
        assert "-H" in (cmd := lab.horovodrun_command(["x"])) and cmd[cmd.index("-H") + 1] == "127.0.0.1:2"
        results = lab.run([sys.executable, str(script)], timeout=90, launcher="horovodrun")
    totals = [float(next(ln for ln in r.output.splitlines() if ln.startswith("HVD ")).split()[5]) for r in results]
    assert totals == [3.0, 3.0]


@needs_lab
def test_ssh_shim_runs_the_command_in_the_hosts_namespace_and_refuses_other_hosts():
    with Lab(2, "none", echo=None) as lab:
        shim = str(lab.ssh_shim())
        # As horovodrun calls it: options before and after the host, the command one quoted word.
        out = subprocess.run([shim, "-o", "PasswordAuthentication=no", lab.addresses[1], "-o", "ConnectTimeout=10",
                              "cd /tmp > /dev/null 2>&1 ; ip -4 -o addr show eth0"],
                             capture_output=True, text=True, timeout=20)  # fmt: skip
        assert out.returncode == 0 and f"inet {lab.addresses[1]}/24" in out.stdout
        other = subprocess.run([shim, "10.0.0.99", "true"], capture_output=True, text=True, timeout=20)
        assert other.returncode == 255 and "not a worker of this lab" in other.stderr
        env = lab.env(0, launcher="horovodrun")
        assert env["PATH"].split(os.pathsep)[0] == os.path.dirname(shim)
        assert "RANK" not in env and "MASTER_ADDR" not in env and env["GLOO_SOCKET_IFNAME"] == "eth0"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


# Writes its pid beside itself (the file system is shared), then sleeps past the run's limit.
SLEEPER = r"""
import os, pathlib, sys, time
rank = os.environ.get("RANK") or os.environ["HOROVOD_RANK"]
pathlib.Path(sys.argv[0]).with_name(f"pid-{rank}").write_text(str(os.getpid()))
time.sleep(120)
"""


@pytest.mark.parametrize(
    ("launcher", "shaped"),
    [pytest.param("torchrun", True, marks=lab_skip), ("torchrun", False),
     pytest.param("horovodrun", False, marks=needs_horovod)],
)  # fmt: skip
def test_launched_workers_are_killed_with_the_run_and_nothing_is_left(tmp_path, launcher, shaped):
    script = tmp_path / "sleep.py"
    script.write_text(SLEEPER)
    pid_files = [tmp_path / f"pid-{r}" for r in range(2)]
    with pytest.raises(LabError, match="ran past the 1 s limit"), Lab(2, "100mbit", shaped=shaped, echo=None) as lab:
        for r in range(1 if launcher == "horovodrun" else 2):
            lab.spawn(r, [sys.executable, str(script)], launcher=launcher)
        deadline = time.monotonic() + 30
        while not all(f.exists() and f.read_text() for f in pid_files) and time.monotonic() < deadline:
            time.sleep(0.1)
        lab.wait(timeout=1)
    # The launchers start their workers in sessions of their own: the lab kills the whole tree under each.
    pids = [int(f.read_text()) for f in pid_files]
    deadline = time.monotonic() + 5  # SIGKILL sent; give the kernel a moment to finish them
    while [p for p in pids if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if _alive(p)]
    assert bl.namespaces(lab.prefix) == [] and not list(labnet.NETNS_ETC.glob(f"{lab.prefix}*"))


def test_bad_launcher_and_horovodrun_rank_are_named():
    with Lab(2, "none", shaped=False, echo=None) as lab:
        with pytest.raises(ValueError, match="unknown launcher 'mpirun'; valid: plain, torchrun, horovodrun"):
            lab.run(["true"], launcher="mpirun")
        with pytest.raises(ValueError, match="horovodrun starts from worker 0 only"):
            lab.command(1, ["true"], "horovodrun")


def test_horovodrun_output_is_split_by_rank():
    text = "[1]<stdout>:b1\n[0]<stdout>:a\nlauncher line\n[0]<stderr>:a2\n[1]<stdout>:b2\n"
    assert bl.split_horovod_output(text, 2) == ["a\na2\n", "b1\nb2\n"]
