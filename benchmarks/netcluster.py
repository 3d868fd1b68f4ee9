"""An emulated cluster of N nodes on one machine: one network namespace per node, joined by a rate-limited link.

    python -m benchmarks.netcluster --nodes 2 --rate 200mbit --nproc-per-node 2 -- script.py --its-args
    python -m benchmarks.netcluster --nodes 2 --rate 200mbit --nproc-per-node 2 -- -m shardfusion.train --steps 5
    python -m benchmarks.netcluster --rate 1gbit --probe        # what the link delivers: a 2-rank all-reduce probe

How it is built (see docs/network-emulation.md; needs root):

- One namespace per node, named ``sfnc-<pid>-<random>-n<node>`` (unique per run; the pid lets a later run remove
  what a killed one left behind). ``lo`` is up in each.
- Two nodes: one veth pair, one end in each namespace. More nodes: a namespace ``...-sw`` holding a bridge (the
  switch), and one veth pair per node, its other end a bridge port.
- Node ``n``'s veth end has the address ``127.10.0.<n+1>/24`` (only 127.0.0.0/8 is used), and
  ``net.ipv4.conf.all.route_localnet=1`` and ``net.ipv4.conf.<veth>.route_localnet=1`` in its namespace, so that
  loopback-range addresses may be routed over a real interface.
- A ``tc`` tbf qdisc on each node's end (and on each switch port: the way into a node) limits what a node sends to
  (and receives from) the others to ``rate``, in each direction; ``rate=None`` sets none ("unlimited": the veth's
  own speed, many Gbit/s).
- torchrun runs once per namespace (``--master-addr 127.10.0.1 --local-addr 127.10.0.<n+1>``) with
  ``GLOO_SOCKET_IFNAME`` set to the namespace's veth: gloo binds every rank of node ``n`` to ``127.10.0.<n+1>``.
  Ranks of one node reach each other on that local address, which the kernel delivers over ``lo`` (never the veth);
  ranks of other nodes only through the veth and its tbf.
- ``/sys/class/net/<veth>/statistics/tx_bytes`` in a node's namespace counts the bytes that left the node.

The tbf (token bucket filter) parameters, chosen so that it delivers its rate from 100 Mbit/s to 1 Gbit/s and more:

- ``burst`` = max(256 KiB, 2 ms at the rate). TCP hands the veth GSO packets of up to 64 KiB; a bucket smaller
  than a packet makes tbf cut it into MTU-sized frames (more packets, and the counters then include a header per
  frame) or drop it. And tbf refills only when its timer fires: when the softirq runs late on a busy machine, the
  tokens of the lateness beyond ``burst`` are lost, so the bucket covers a few ms of the rate (256 KiB is 2 ms at
  1 Gbit/s). The cost: after an idle moment up to ``burst`` bytes leave at once, which a real link would not allow
  (small against the megabytes of a gradient all-reduce).
- ``limit`` (queued bytes before tbf drops) = max(8 MiB, 50 ms at the rate): above what TCP keeps queued per flow
  (tcp_limit_output_bytes, 4 MiB here) for the few flows between two nodes, so that a bulk transfer is paced by the
  bucket, not by drops and retransmissions (which would add bytes to the counters and stall the flow).
- ``mtu`` 9000 (jumbo frames, as cluster networks use): tbf charges every packet its frame length, headers included
  per MTU-sized segment, so the payload gets ~99.3% of the rate at 9000 (~95.6% at 1500).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional, Sequence, Union

REPO = Path(__file__).resolve().parent.parent
NS_PREFIX = "sfnc"
ADDR_PREFIX = "127.10.0."
MASTER_PORT = 29400
DEFAULT_MTU = 9000
MIN_BURST_BYTES = 256 * 1024
BURST_SECONDS = 0.002
MIN_LIMIT_BYTES = 8 * 1024 * 1024
LIMIT_SECONDS = 0.05
_TORCHRUN_VARS = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                  "TORCHELASTIC_USE_AGENT_STORE", "LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE",
                  "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class ClusterError(RuntimeError):
    """A command in the emulated cluster failed, ran past its timeout, or the cluster could not be set up; the
    message carries the end of the logs of the processes involved."""


# ---- rates and tbf parameters -------------------------------------------------------------------------------------
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
               "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9}


def parse_rate(rate: Union[str, int, None]) -> Optional[int]:
    """Bits per second of ``rate``: an int (bit/s), a tc-style string (``"200mbit"``, ``"1gbit"``, ``"500kbit"``,
    ``"100mbps"`` = megabytes/s; SI prefixes, powers of 1000), or ``None``/``"unlimited"``/``"none"`` (no limit:
    None).

    Raises:
        ValueError: anything else, or a rate that is not positive.
    """
    if rate is None or (isinstance(rate, str) and rate.strip().lower() in ("unlimited", "none", "")):
        return None
    if isinstance(rate, bool):
        raise ValueError(f"rate must be a string like '200mbit', an int in bit/s, or None, got {rate!r}")
    if isinstance(rate, int):
        bps = rate
    elif isinstance(rate, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)\s*", rate.lower())
        if m is None or m.group(2) not in _RATE_UNITS:
            raise ValueError(f"rate {rate!r}: expected a number and one of {sorted(_RATE_UNITS)} "
                             f"(e.g. '200mbit'), or 'unlimited'")
        bps = int(float(m.group(1)) * _RATE_UNITS[m.group(2)])
    else:
        raise ValueError(f"rate must be a string like '200mbit', an int in bit/s, or None, got {rate!r}")
    if bps <= 0:
        raise ValueError(f"rate must be positive, got {rate!r} ({bps} bit/s)")
    return bps


def format_rate(bps: Optional[int]) -> str:
    """``"unlimited"``, or the rate in the largest SI unit that divides it (``200000000 -> "200mbit"``)."""
    if bps is None:
        return "unlimited"
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bps % _RATE_UNITS[unit] == 0:
            return f"{bps // _RATE_UNITS[unit]}{unit}"
    return f"{bps}bit"


def tbf_params(rate_bps: int) -> dict[str, int]:
    """``{"burst": bytes, "limit": bytes}`` of the tbf for a rate in bit/s (see the module doc for why)."""
    per_s = rate_bps / 8
    return {"burst": int(max(MIN_BURST_BYTES, per_s * BURST_SECONDS)),
            "limit": int(max(MIN_LIMIT_BYTES, per_s * LIMIT_SECONDS))}


# ---- commands ---------------------------------------------------------------------------------------------------
def _sh(argv: Sequence[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} exited with {result.returncode}: {result.stderr.strip()}")
    return result


_AVAILABLE: Optional[tuple[bool, str]] = None


def netns_available() -> tuple[bool, str]:
    """``(True, "")`` if this process can build an emulated cluster, else ``(False, why)``: it needs root (or
    CAP_NET_ADMIN and CAP_SYS_ADMIN), ``ip`` and ``tc`` (iproute2), and a working ``ip netns add`` / veth / tbf,
    which it tries once on a namespace of its own (deleted again). The answer is cached for the process."""
    global _AVAILABLE
    if _AVAILABLE is not None:
        return _AVAILABLE
    _AVAILABLE = _probe_netns()
    return _AVAILABLE


def _probe_netns() -> tuple[bool, str]:
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux, this is {sys.platform}"
    for tool in ("ip", "tc", "sysctl"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` not found on PATH (iproute2 / procps)"
    if os.geteuid() != 0:
        return False, f"creating network namespaces needs root; euid is {os.geteuid()}"
    name = f"{NS_PREFIX}-{os.getpid()}-{secrets.token_hex(3)}-probe"
    steps = [["ip", "netns", "add", name],
             ["ip", "-n", name, "link", "add", "pa", "type", "veth", "peer", "name", "pb"],
             ["ip", "netns", "exec", name, "sysctl", "-q", "-w", "net.ipv4.conf.all.route_localnet=1"],
             ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "1gbit",
              "burst", "256kb", "limit", "1mb"]]
    try:
        for argv in steps:
            try:
                r = _sh(argv, check=False)
            except (OSError, subprocess.TimeoutExpired) as e:
                return False, f"`{' '.join(argv)}` failed: {e}"
            if r.returncode != 0:
                return False, f"`{' '.join(argv)}` failed: {r.stderr.strip() or r.returncode}"
        return True, ""
    finally:
        _sh(["ip", "netns", "delete", name], check=False)


def descendants(pid: int) -> list[int]:
    """Processes below ``pid`` (children first), from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        children = [c for c, p in parents.items() if p in frontier]
        found += children
        frontier = children
    return found


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and every process below it (torchrun's workers run in sessions of their own)."""
    if proc.poll() is not None:
        return
    for pid in descendants(proc.pid)[::-1] + [proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _tail(path: Optional[Path], chars: int = 3000) -> str:
    if path is None:
        return "(no log)"
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"(log {path} unreadable: {e})"
    return text[-chars:] if text else "(empty log)"


def sweep_stale() -> list[str]:
    """Delete the namespaces named ``sfnc-<pid>-...`` whose pid is no longer alive (left behind by a run that was
    killed with SIGKILL, which no handler can catch); returns their names."""
    r = _sh(["ip", "netns", "list"], check=False)
    gone = []
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"{NS_PREFIX}-(\d+)-[0-9a-f]+-\w+", name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            _sh(["ip", "netns", "delete", name], check=False)
            gone.append(name)
    return gone


# ---- clean-up on exit and signals -------------------------------------------------------------------------------
_LIVE: dict[int, "EmulatedCluster"] = {}
_LOCK = threading.RLock()  # re-entrant: a signal handler may close clusters while the main thread holds it
_PREV_HANDLERS: dict[int, object] = {}
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_ATEXIT_DONE = False


def _close_all() -> None:
    for cluster in list(_LIVE.values()):
        try:
            cluster.close()
        except Exception as e:  # noqa: BLE001 (clean-up goes on with the next cluster)
            print(f"netcluster: cleaning up {cluster.netns(0)}: {e}", file=sys.stderr)


def _on_signal(signum, frame) -> None:
    _close_all()
    prev = _PREV_HANDLERS.get(signum, signal.SIG_DFL)
    _restore_handlers()
    if callable(prev):
        prev(signum, frame)  # e.g. Python's SIGINT handler: KeyboardInterrupt
    elif prev != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_handlers() -> None:
    global _ATEXIT_DONE
    if not _ATEXIT_DONE:
        atexit.register(_close_all)
        _ATEXIT_DONE = True
    if _PREV_HANDLERS or threading.current_thread() is not threading.main_thread():
        return  # installed already, or not allowed here (signal handlers live in the main thread)
    for sig in _SIGNALS:
        _PREV_HANDLERS[sig] = signal.getsignal(sig)
        signal.signal(sig, _on_signal)


def _restore_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, prev in list(_PREV_HANDLERS.items()):
        if signal.getsignal(sig) is _on_signal:
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
    _PREV_HANDLERS.clear()


# ---- the cluster ------------------------------------------------------------------------------------------------
class EmulatedCluster:
    """``nodes`` emulated nodes (network namespaces) joined by links of ``rate`` each way (see the module doc).

    Use it as a context manager: the namespaces exist inside the ``with`` block and are deleted on leaving it, with
    every process still running in them; also at interpreter exit and on SIGINT/SIGTERM/SIGHUP (the previous handler
    runs afterwards).

    Args:
        nodes: number of nodes, 2..254.
        rate: the per-node, per-direction link rate: ``"200mbit"``, an int in bit/s, or None (no limit); see
            :func:`parse_rate`.
        mtu: the veths' MTU in bytes (576..65535).

    Raises:
        ValueError: ``nodes`` or ``mtu`` out of range, or a bad ``rate``.
        ClusterError: (on entering) a setup command failed; what was made is removed again.
    """

    def __init__(self, nodes: int = 2, rate: Union[str, int, None] = None, *, mtu: int = DEFAULT_MTU):
        if isinstance(nodes, bool) or not isinstance(nodes, int) or not 2 <= nodes <= 254:
            raise ValueError(f"nodes must be an int in 2..254, got {nodes!r}")
        if isinstance(mtu, bool) or not isinstance(mtu, int) or not 576 <= mtu <= 65535:
            raise ValueError(f"mtu must be an int in 576..65535 bytes, got {mtu!r}")
        self.nodes = nodes
        self.rate_bps = parse_rate(rate)
        self.rate = format_rate(self.rate_bps)
        self.mtu = mtu
        self.tbf = tbf_params(self.rate_bps) if self.rate_bps is not None else None
        token = secrets.token_hex(3)
        self._owner = os.getpid()
        self._names = [f"{NS_PREFIX}-{self._owner}-{token}-n{n}" for n in range(nodes)]
        self._switch = f"{NS_PREFIX}-{self._owner}-{token}-sw" if nodes > 2 else None
        self._ifnames = [f"sfv{token}n{n}"[:15] for n in range(nodes)]
        self._procs: list[subprocess.Popen] = []
        self._logs: dict[int, Path] = {}
        self._tmp: Optional[str] = None
        self._port = MASTER_PORT
        self._open = False

    # -- names ------------------------------------------------------------------------------------------------------
    def addr(self, node: int) -> str:
        """Node ``node``'s address, ``"127.10.0.<node+1>"``."""
        return ADDR_PREFIX + str(self._check(node) + 1)

    def ifname(self, node: int) -> str:
        """The name of node ``node``'s veth end (in its namespace)."""
        return self._ifnames[self._check(node)]

    def netns(self, node: int) -> str:
        """The name of node ``node``'s network namespace."""
        return self._names[self._check(node)]

    def _check(self, node: int) -> int:
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < self.nodes:
            raise ValueError(f"node must be an int in 0..{self.nodes - 1}, got {node!r}")
        return node

    # -- set-up and tear-down ---------------------------------------------------------------------------------------
    def __enter__(self) -> "EmulatedCluster":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        """Create the namespaces, links and qdiscs (what ``with`` does on entering)."""
        if self._open:
            return
        ok, why = netns_available()
        if not ok:
            raise ClusterError(f"cannot emulate a cluster here: {why}")
        sweep_stale()
        with _LOCK:
            _install_handlers()
            _LIVE[id(self)] = self
        self._open = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        for name in self._names + ([self._switch] if self._switch else []):
            _sh(["ip", "netns", "add", name])
            _sh(["ip", "-n", name, "link", "set", "lo", "up"])
        if self._switch is None:  # two nodes: one veth pair
            _sh(["ip", "-n", self._names[0], "link", "add", self._ifnames[0], "mtu", str(self.mtu), "type", "veth",
                 "peer", "name", self._ifnames[1], "mtu", str(self.mtu), "netns", self._names[1]])
        else:  # a bridge in the switch namespace, one veth pair per node
            sw = self._switch
            _sh(["ip", "-n", sw, "link", "add", "br0", "mtu", str(self.mtu), "type", "bridge"])
            _sh(["ip", "-n", sw, "link", "set", "br0", "up"])
            for n in range(self.nodes):
                port = f"p{n}"
                _sh(["ip", "-n", sw, "link", "add", port, "mtu", str(self.mtu), "type", "veth", "peer", "name",
                     self._ifnames[n], "mtu", str(self.mtu), "netns", self._names[n]])
                _sh(["ip", "-n", sw, "link", "set", port, "master", "br0", "up"])
                self._limit(sw, port)
        for n in range(self.nodes):
            ns, dev = self._names[n], self._ifnames[n]
            _sh(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.conf.all.route_localnet=1",
                 f"net.ipv4.conf.{dev}.route_localnet=1"])
            _sh(["ip", "-n", ns, "addr", "add", f"{self.addr(n)}/24", "dev", dev])
            _sh(["ip", "-n", ns, "link", "set", dev, "up"])
            self._limit(ns, dev)

    def _limit(self, ns: str, dev: str) -> None:
        if self.tbf is None:
            return
        _sh(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
             f"{self.rate_bps}bit", "burst", str(self.tbf["burst"]), "limit", str(self.tbf["limit"])])

    def close(self) -> None:
        """Kill every process still running in the namespaces (and those this cluster started), delete the
        namespaces (and with them the veths and qdiscs); idempotent."""
        if not self._open or os.getpid() != self._owner:
            return
        self._open = False
        for proc in self._procs:
            _kill_tree(proc)
        for name in self._names + ([self._switch] if self._switch else []):
            r = _sh(["ip", "netns", "pids", name], check=False)
            for pid in r.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _sh(["ip", "netns", "delete", name], check=False)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        with _LOCK:
            _LIVE.pop(id(self), None)
            if not _LIVE:
                _restore_handlers()

    def _need_open(self) -> None:
        if not self._open:
            raise ClusterError("the cluster is not open: use it inside `with EmulatedCluster(...) as cluster:`")

    # -- processes --------------------------------------------------------------------------------------------------
    def base_env(self, node: int, env: Optional[dict] = None) -> dict[str, str]:
        """The environment of a command on ``node``: this one without torchrun's variables, with
        ``GLOO_SOCKET_IFNAME`` = the node's veth, ``OMP_NUM_THREADS=1``, ``PYTHONUNBUFFERED=1``, then ``env``."""
        out = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
        out.update(GLOO_SOCKET_IFNAME=self.ifname(node), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        out.update(env or {})
        return out

    def popen(self, node: int, argv: Sequence[str], env: Optional[dict] = None, *, cwd=None, log: Optional[Path] = None,
              **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside node ``node``'s namespace (``ip netns exec``), in a session of its own, with
        :meth:`base_env` + ``env``; with ``log``, stdout and stderr go to that file. The cluster kills it (and what
        it started) when it closes. Other keywords go to ``subprocess.Popen``."""
        self._need_open()
        if log is not None:
            log = Path(log)
            log.parent.mkdir(parents=True, exist_ok=True)
            handle = open(log, "w")
            kwargs.update(stdout=handle, stderr=subprocess.STDOUT)
        try:
            proc = subprocess.Popen(["ip", "netns", "exec", self.netns(node), *argv], env=self.base_env(node, env),
                                    cwd=cwd, start_new_session=True, **kwargs)
        finally:
            if log is not None:
                handle.close()
        self._procs.append(proc)
        if log is not None:
            self._logs[proc.pid] = log
        return proc

    def run(self, node: int, argv: Sequence[str], env: Optional[dict] = None, *, timeout: float = 60,
            check: bool = True, cwd=None) -> subprocess.CompletedProcess:
        """Run ``argv`` inside node ``node``'s namespace to its end, output captured as text.

        Raises:
            ClusterError: it exited non-zero (with ``check``) or ran past ``timeout`` seconds (then it is killed).
        """
        proc = self.popen(node, argv, env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            out, err = proc.communicate()
            raise ClusterError(f"node {node}: {list(argv)} ran past {timeout} s:\n{out[-2000:]}\n{err[-2000:]}")
        if check and proc.returncode != 0:
            raise ClusterError(f"node {node}: {list(argv)} exited with {proc.returncode}:\n{out[-2000:]}\n"
                               f"{err[-2000:]}")
        return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)

    def torchrun(self, argv: Sequence[str], nproc_per_node: int = 2, env: Optional[dict] = None,
                 log_dir: Optional[Union[str, Path]] = None, *, cwd=None,
                 extra_args: Sequence[str] = ()) -> list[subprocess.Popen]:
        """Start one torchrun per node: ``--nnodes N --node-rank n --nproc-per-node P --master-addr 127.10.0.1
        --master-port <port> --local-addr 127.10.0.<n+1> --max-restarts 0`` (static rendezvous: node 0's agent
        hosts the c10d TCPStore on 127.10.0.1), then ``extra_args`` (more torchrun flags), then ``argv`` (a script
        and its arguments, or ``-m module ...``). Global rank = n * P + local rank, so nodes hold consecutive ranks.
        Each node's output goes to ``<log_dir>/node<n>.log`` (default: a folder of this job's own, deleted with the
        cluster). Several jobs may run at once (each gets its own master port).

        Returns:
            the torchrun processes, node by node; pass them to :meth:`wait`.

        Raises:
            ValueError: ``nproc_per_node`` < 1 or an empty ``argv``.
        """
        self._need_open()
        if isinstance(nproc_per_node, bool) or not isinstance(nproc_per_node, int) or nproc_per_node < 1:
            raise ValueError(f"nproc_per_node must be an int >= 1, got {nproc_per_node!r}")
        if not argv:
            raise ValueError("argv must name a script (or -m module) to run, got nothing")
        port, self._port = self._port, self._port + 1  # a fresh port per job: the namespaces are ours alone
        if log_dir is None:
            if self._tmp is None:
                self._tmp = tempfile.mkdtemp(prefix="netcluster-")
            log_dir = Path(self._tmp) / f"job-{port}"  # jobs may run at the same time: a folder each
        log_dir = Path(log_dir)
        procs = []
        for n in range(self.nodes):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.nodes), "--node-rank", str(n),
                   "--nproc-per-node", str(nproc_per_node), "--master-addr", self.addr(0), "--master-port",
                   str(port), "--local-addr", self.addr(n), "--max-restarts", "0", "--monitor-interval", "0.2",
                   *extra_args, *argv]
            procs.append(self.popen(n, cmd, env, cwd=cwd, log=log_dir / f"node{n}.log"))
        return procs

    def log(self, proc: subprocess.Popen) -> Optional[Path]:
        """The log file of a process started with a log (every torchrun), or None."""
        return self._logs.get(proc.pid)

    def wait(self, procs: Sequence[subprocess.Popen], timeout: float) -> list[int]:
        """Wait for ``procs`` to end; returns their exit codes (all 0).

        Raises:
            ClusterError: one exited non-zero, or they ran past ``timeout`` seconds: every one of ``procs`` (and
                what it started) is killed first; the message has the end of each one's log.
        """
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad or time.monotonic() > deadline:
                if bad:
                    time.sleep(1.0)  # let the others report the failure in their logs, then stop them
                for p in procs:
                    _kill_tree(p)
                what = (", ".join(f"process {i} exited with {c}" for i, c in bad) if bad
                        else f"ran past {timeout} s")
                tails = "\n".join(f"---- process {i} (log {self.log(p)}):\n{_tail(self.log(p))}"
                                  for i, p in enumerate(procs))
                raise ClusterError(f"cluster job failed: {what}; all stopped.\n{tails}")
            if all(c == 0 for c in codes):
                return codes
            time.sleep(0.05)

    # -- counters ---------------------------------------------------------------------------------------------------
    def _stat(self, node: int, name: str) -> int:
        r = _sh(["ip", "netns", "exec", self.netns(node), "cat",
                 f"/sys/class/net/{self.ifname(node)}/statistics/{name}"])
        return int(r.stdout.strip())

    def tx_bytes(self) -> list[int]:
        """Bytes sent by each node's veth since it was made (``/sys/class/net/<veth>/statistics/tx_bytes``, read in
        the node's namespace): what left the node, frame headers included (one per GSO packet, not per MTU)."""
        self._need_open()
        return [self._stat(n, "tx_bytes") for n in range(self.nodes)]

    def rx_bytes(self) -> list[int]:
        """Bytes received by each node's veth (``rx_bytes``), as :meth:`tx_bytes`."""
        self._need_open()
        return [self._stat(n, "rx_bytes") for n in range(self.nodes)]

    def qdisc_stats(self) -> list[dict]:
        """Per node: the tbf's ``{"bytes", "packets", "drops", "overlimits"}`` on its veth (``tc -s``), or {} with no
        limit."""
        self._need_open()
        out = []
        for n in range(self.nodes):
            r = _sh(["ip", "netns", "exec", self.netns(n), "tc", "-s", "-j", "qdisc", "show", "dev", self.ifname(n)])
            q = next((q for q in json.loads(r.stdout or "[]") if q.get("kind") == "tbf"), None)
            out.append({} if q is None else {k: q.get(k, 0) for k in ("bytes", "packets", "drops", "overlimits")})
        return out

    def describe(self) -> dict:
        """The cluster's layout and link settings, for a report."""
        return {"nodes": self.nodes, "rate": self.rate, "rate_bps": self.rate_bps, "mtu": self.mtu,
                "tbf": self.tbf, "addrs": [self.addr(n) for n in range(self.nodes)],
                "topology": "veth pair" if self._switch is None else "bridge (switch namespace), a veth per node"}


# ---- the link probe ---------------------------------------------------------------------------------------------
def _probe_worker(out: str, mbytes: float, iters: int, intra: bool) -> None:
    """Under torchrun: all-reduce a float32 tensor of ``mbytes`` MB ``iters`` times; without ``intra``, over the
    ranks of local rank 0 (one per node: everything crosses the link), with ``intra``, only within each node.
    Node 0's local rank 0 writes ``out``: the seconds of each iteration, the slowest rank's."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    node, local_rank = rank // local, rank % local
    cross = [n * local for n in range(world // local)]
    groups = [dist.new_group(cross)] + [dist.new_group(list(range(n * local, (n + 1) * local)))
                                        for n in range(world // local)]
    group = groups[1 + node] if intra else (groups[0] if local_rank == 0 else None)
    x = torch.ones(int(mbytes * 1e6 / 4))
    times = []
    for i in range(iters + 1):  # the first one connects and warms up
        dist.barrier()
        t0 = time.perf_counter()
        if group is not None:
            dist.all_reduce(x, group=group)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i:
            times.append(float(dt))
    if rank == 0:
        Path(out).write_text(json.dumps({"times_s": times, "nbytes": x.numel() * 4, "world": world,
                                         "local": local}))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # see benchmarks/spawn.py: no process-group teardown after the last collective


def probe(cluster: EmulatedCluster, mbytes: float = 16.0, iters: int = 3, intra: bool = False,
          timeout: float = 300) -> dict:
    """What the link delivers: all-reduce ``mbytes`` MB (N bytes) of float32 between one rank per node, ``iters``
    times, timing each. A ring all-reduce over G nodes makes each rank send 2(G-1)/G x N (2 nodes: N, a
    reduce-scatter of N/2 then an all-gather of N/2) to its neighbour, over the link.

    Returns ``{"set_bps", "achieved_bps" (median payload rate: 2(G-1)/G x N x 8 / time), "median_s", "ratio",
    "times_s", "tx_bytes_per_iter" (per node, veth counters), "payload_bytes_per_iter", "qdisc", "intra"}``; with
    ``intra``, the all-reduce runs within each node instead (2 ranks per node) and ``tx_bytes_per_iter`` shows that
    it does not cross the link (bit/s are of payload; ``ratio`` = achieved / set, None without a limit).
    """
    with tempfile.TemporaryDirectory(prefix="netcluster-probe-") as tmp:
        out = os.path.join(tmp, "probe.json")
        before = cluster.tx_bytes()
        procs = cluster.torchrun(["-m", "benchmarks.netcluster", "--probe-worker", out, str(mbytes), str(iters),
                                  "1" if intra else "0"], nproc_per_node=2 if intra else 1, cwd=REPO,
                                 env={"PYTHONPATH": str(REPO)}, log_dir=tmp)
        cluster.wait(procs, timeout)
        after = cluster.tx_bytes()
        res = json.loads(Path(out).read_text())
    times = sorted(res["times_s"])
    median = times[len(times) // 2]
    nbytes = res["nbytes"]
    # Per iteration each node sends N bytes (2 nodes; its share of the ring); the barriers and the timing
    # all-reduces add a few hundred bytes.
    tx = [(a - b) / (iters + 1) for a, b in zip(after, before)]
    g = cluster.nodes
    payload = 0 if intra else 2 * (g - 1) * nbytes / g  # what a ring all-reduce makes each rank send
    achieved = payload * 8 / median if not intra else nbytes * 8 / median
    return {"set_bps": cluster.rate_bps, "achieved_bps": achieved, "median_s": median,
            "ratio": None if cluster.rate_bps is None else achieved / cluster.rate_bps, "times_s": res["times_s"],
            "payload_bytes_per_iter": payload, "tx_bytes_per_iter": tx,
            "qdisc": cluster.qdisc_stats(), "intra": intra}


# ---- CLI --------------------------------------------------------------------------------------------------------
def _human(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--probe-worker"]:
        _probe_worker(argv[1], float(argv[2]), int(argv[3]), argv[4] == "1")
        return 0
    command: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -m benchmarks.netcluster", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--rate", default="200mbit", help="per node and direction, e.g. 100mbit, 1gbit, unlimited")
    p.add_argument("--mtu", type=int, default=DEFAULT_MTU)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--timeout", type=float, default=3600, help="seconds before the job is killed")
    p.add_argument("--log-dir", default=None, help="keep each node's torchrun output here (node<n>.log)")
    p.add_argument("--probe", action="store_true",
                   help="instead of a command: all-reduce probes across the link and within a node")
    p.add_argument("--probe-mb", type=float, default=16.0)
    args = p.parse_args(argv)
    if not args.probe and not command:
        p.error("give the command after `--` (a script and its arguments, or -m module ...), or --probe")
    ok, why = netns_available()
    if not ok:
        print(f"netcluster: cannot emulate a cluster here: {why}", file=sys.stderr)
        return 2
    try:
        rate = parse_rate(args.rate)
    except ValueError as e:
        p.error(f"--rate: {e}")
    with EmulatedCluster(nodes=args.nodes, rate=rate, mtu=args.mtu) as cluster:
        d = cluster.describe()
        print(f"netcluster: {d['nodes']} nodes ({', '.join(d['addrs'])}), {d['topology']}, rate {d['rate']}, "
              f"mtu {d['mtu']}, tbf {d['tbf']}", flush=True)
        if args.probe:
            for intra in (False, True):
                r = probe(cluster, args.probe_mb, intra=intra)
                what = "within each node (2 ranks)" if intra else "across nodes (1 rank per node)"
                rate_s = (f"{r['achieved_bps'] / 1e6:.1f} Mbit/s of payload"
                          + ("" if r["ratio"] is None or intra else f", {100 * r['ratio']:.1f}% of the set rate"))
                print(f"all-reduce of {args.probe_mb} MB {what}: median {r['median_s']:.3f} s, {rate_s}; "
                      f"veth tx per iteration {[_human(t) for t in r['tx_bytes_per_iter']]} "
                      f"(payload {_human(r['payload_bytes_per_iter'])}); qdisc {r['qdisc']}")
            return 0
        before = cluster.tx_bytes()
        t0 = time.time()
        procs = cluster.torchrun(command, nproc_per_node=args.nproc_per_node, log_dir=args.log_dir)
        code = 0
        try:
            cluster.wait(procs, args.timeout)
        except ClusterError as e:
            print(e, file=sys.stderr)
            code = 1
        wall = time.time() - t0
        if code == 0:
            for n, proc in enumerate(procs):
                print(f"---- node {n} output ----\n{_tail(cluster.log(proc), 20000)}")
        after = cluster.tx_bytes()
        for n in range(cluster.nodes):
            print(f"node {n} ({cluster.addr(n)}): sent {_human(after[n] - before[n])} over the link "
                  f"({after[n] - before[n]} bytes)")
        print(f"wall {wall:.1f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
