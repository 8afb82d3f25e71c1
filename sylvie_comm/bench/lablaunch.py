"""The lab's launch part: each worker's command and environment, for the three launchers.

:class:`Launch` is what :class:`~sylvie_comm.bench.lab.Lab` knows about starting a worker once the
network is up: ``plain`` (the command itself, with the ``torch.distributed`` environment), ``torchrun``
(one node per worker, static rendezvous at worker 0's address) and ``horovodrun`` (from worker 0, over
the lab's own ``ssh``, which runs each host's command in the namespace holding its address).
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from sylvie_comm.bench.labnet import LabError
from sylvie_comm.bench.labproc import check_launcher, horovodrun_executable

# Set by the lab for a plain rank; torchrun and horovodrun set what their workers need themselves.
_DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
              "GROUP_RANK", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
              "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME", "HOROVOD_GLOO_RENDEZVOUS_ADDR",
              "HOROVOD_GLOO_RENDEZVOUS_PORT")  # fmt: skip


class Launch:
    """Commands and environments of a lab's workers (the lab sets the attributes when it opens)."""

    workers: int
    link: str
    shaped: bool
    addresses: list[str]
    master_port: int
    worker_namespaces: list[str]
    _logdir: tempfile.TemporaryDirectory[str] | None

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.workers:
            raise ValueError(f"Lab: rank {rank} out of range for {self.workers} workers")

    # ------------------------------------------------------------------ cleaning up

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
