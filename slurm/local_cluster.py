"""A real Slurm cluster on this one machine, for tests: munge, MariaDB, slurmdbd, slurmctld and
one `slurmd -N <node>` per node, all started directly (no systemd) as root.

Everything the cluster writes (configs, logs, pid files, spool, job state, the MariaDB data)
lives under one directory: $K3_SLURM_DIR, default /tmp/k3-slurm. Clients find the cluster
through SLURM_CONF=<root>/etc/slurm.conf (see `ClusterInfo.env`).

    python -m slurm.local_cluster start --nodes 2   # no-op when already running as asked
    python -m slurm.local_cluster status
    python -m slurm.local_cluster stop [--purge]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import string
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_ROOT = "/tmp/k3-slurm"
TEMPLATES = Path(__file__).with_name("cluster_conf")
APT_PACKAGES = ("slurm-wlm", "slurmdbd", "munge", "mariadb-server", "slurm-client")
APT_INSTALL = (
    "apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "
    + " ".join(APT_PACKAGES)
)
REQUIRED_PROGRAMS = (
    "munged", "munge", "unmunge", "mungekey", "runuser",
    "mariadbd", "mariadb-install-db", "mariadb",
    "slurmdbd", "slurmctld", "slurmd",
    "sacctmgr", "sinfo", "scontrol", "squeue", "scancel", "sbatch", "srun", "sacct",
)  # fmt: skip
MUNGE_KEY = Path("/etc/munge/munge.key")
MUNGE_RUN_DIR = Path("/run/munge")
CGROUP_FREEZER = Path("/sys/fs/cgroup/freezer")
NODE_UP_STATES = {"idle", "mixed", "allocated", "completing"}


class ClusterError(RuntimeError):
    """The cluster could not be started; the message carries the relevant log tails."""


def _host_cpus() -> int:
    return len(os.sched_getaffinity(0))


def _host_memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    raise ClusterError("MemTotal missing from /proc/meminfo")


def _proctrack_plugin() -> str:
    """proctrack/cgroup needs a cgroup v1 freezer we may write to (present in some sandboxes,
    absent in many containers); proctrack/linuxproc works everywhere."""
    probe = CGROUP_FREEZER / f"k3-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError:
        return "proctrack/linuxproc"
    return "proctrack/cgroup"


def _usable_memory_mb() -> int:
    """What the nodes may hand out: the rest stays with the OS, MariaDB and the daemons."""
    total = _host_memory_mb()
    return total - max(2048, total // 8)


def slurm_env(slurm_conf: Path) -> dict[str, str]:
    """This process's environment pointed at `slurm_conf`; slurmdbd finds slurmdbd.conf beside
    it."""
    return {**os.environ, "SLURM_CONF": str(slurm_conf)}


@dataclass(frozen=True)
class ClusterConfig:
    root: Path = field(default_factory=lambda: Path(os.environ.get("K3_SLURM_DIR", DEFAULT_ROOT)))
    nodes: int = 2
    cluster_name: str = "k3local"
    partition: str = "debug"
    ctld_port: int = 6817
    dbd_port: int = 6819
    first_node_port: int = 6821
    mysql_port: int = 3307
    # Every node advertises all host CPUs: oversubscribed, but a 2-node job with several tasks
    # per node stays schedulable on a 2-core machine.
    cpus_per_node: int = field(default_factory=_host_cpus)
    memory_per_node_mb: int | None = None  # None: the usable memory split evenly over nodes
    proctrack: str = field(default_factory=_proctrack_plugin)
    cred_expire_s: int = 10
    db_name: str = "slurm_acct_db"
    db_user: str = "slurm"
    db_password: str = "k3-local-slurm"

    @property
    def etc_dir(self) -> Path:
        return self.root / "etc"

    @property
    def log_dir(self) -> Path:
        return self.root / "log"

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def spool_dir(self) -> Path:
        return self.root / "spool"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def mysql_dir(self) -> Path:
        return self.root / "mysql"

    @property
    def slurm_conf(self) -> Path:
        return self.etc_dir / "slurm.conf"

    @property
    def node_names(self) -> tuple[str, ...]:
        return tuple(f"n{i}" for i in range(1, self.nodes + 1))

    def env(self) -> dict[str, str]:
        return slurm_env(self.slurm_conf)


@dataclass(frozen=True)
class ClusterInfo:
    """What tests need to know about a running cluster."""

    cluster_name: str
    partition: str
    nodes: tuple[str, ...]
    node_addrs: dict[str, str]
    root: Path
    slurm_conf: Path
    log_dir: Path
    spool_dir: Path
    state_dir: Path
    started_here: bool  # False: `start` found it already running as configured
    startup_s: float  # 0.0 when it was already running

    def env(self) -> dict[str, str]:
        """The environment for Slurm clients (sbatch, srun, sacct, ...) to reach this cluster."""
        return slurm_env(self.slurm_conf)


# ---------------------------------------------------------------- configuration files


def _render(template: str, **values: object) -> str:
    return string.Template((TEMPLATES / template).read_text()).substitute(values)


def render_slurm_conf(cfg: ClusterConfig) -> str:
    memory = cfg.memory_per_node_mb or _usable_memory_mb() // cfg.nodes
    hostname = socket.gethostname()
    node_lines = "\n".join(
        f"NodeName={name} NodeHostname={hostname} NodeAddr=127.0.0.1 "
        f"Port={cfg.first_node_port + i} CPUs={cfg.cpus_per_node} RealMemory={memory} "
        "State=UNKNOWN"
        for i, name in enumerate(cfg.node_names)
    )
    return _render(
        "slurm.conf.in",
        **_paths(cfg),
        cluster_name=cfg.cluster_name,
        ctld_port=cfg.ctld_port,
        dbd_port=cfg.dbd_port,
        cred_expire_s=cfg.cred_expire_s,
        proctrack=cfg.proctrack,
        node_lines=node_lines,
        node_list=",".join(cfg.node_names),
        partition=cfg.partition,
    )


def _paths(cfg: ClusterConfig) -> dict[str, Path]:
    return {
        "log_dir": cfg.log_dir,
        "run_dir": cfg.run_dir,
        "spool_dir": cfg.spool_dir,
        "state_dir": cfg.state_dir,
        "mysql_dir": cfg.mysql_dir,
    }


def _write_configs(cfg: ClusterConfig) -> None:
    node_spools = [cfg.spool_dir / f"slurmd-{name}" for name in cfg.node_names]
    for directory in (cfg.etc_dir, cfg.log_dir, cfg.run_dir, cfg.state_dir, *node_spools):
        directory.mkdir(parents=True, exist_ok=True)
    cfg.slurm_conf.write_text(render_slurm_conf(cfg))
    (cfg.etc_dir / "cgroup.conf").write_text(_render("cgroup.conf.in"))
    dbd_conf = cfg.etc_dir / "slurmdbd.conf"
    dbd_conf.write_text(
        _render(
            "slurmdbd.conf.in",
            **_paths(cfg),
            dbd_port=cfg.dbd_port,
            mysql_port=cfg.mysql_port,
            db_name=cfg.db_name,
            db_user=cfg.db_user,
            db_password=cfg.db_password,
        )
    )
    dbd_conf.chmod(0o600)  # slurmdbd refuses a readable config (it holds the DB password)
    (cfg.etc_dir / "my.cnf").write_text(
        _render("my.cnf.in", **_paths(cfg), mysql_port=cfg.mysql_port)
    )


# ---------------------------------------------------------------- processes


def _pid_alive(pid: int, program: str) -> bool:
    """True if `pid` runs `program` (a recycled pid or a zombie does not count)."""
    proc = Path(f"/proc/{pid}")
    try:
        state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        cmdline = (proc / "cmdline").read_bytes().split(b"\0")[0].decode()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z" and Path(cmdline).name == program


def _read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().split()[0])
    except (FileNotFoundError, ValueError, IndexError):
        return None


# Daemons this process spawned, kept so they are reaped instead of lingering as zombies.
_children: dict[int, subprocess.Popen] = {}


def _spawn(cfg: ClusterConfig, name: str, argv: Sequence[str]) -> subprocess.Popen:
    """Start a daemon in the foreground of its own session; its stdout/stderr go to a file."""
    with open(cfg.log_dir / f"{name}.out", "ab") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=cfg.env(),
            start_new_session=True,
        )
    _children[proc.pid] = proc
    (cfg.run_dir / f"{name}.pid").write_text(f"{proc.pid}\n")
    return proc


def _stop_pid(pid: int, program: str, timeout_s: float = 10.0) -> None:
    if not _pid_alive(pid, program):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _pid_alive(pid, program) and time.monotonic() < deadline:
        _reap(pid)
        time.sleep(0.1)
    if _pid_alive(pid, program):
        os.kill(pid, signal.SIGKILL)
    _reap(pid, block=True)


def _reap(pid: int, block: bool = False) -> None:
    child = _children.get(pid)
    if child is None:
        return
    if block:
        child.wait(timeout=10)
    elif child.poll() is None:
        return
    del _children[pid]


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return f"--- {path}: (missing)"
    return f"--- {path} (last {lines} lines):\n" + "\n".join(text[-lines:])


def _wait_for(
    ready: Callable[[], bool],
    what: str,
    logs: Sequence[Path],
    timeout_s: float,
    procs: Sequence[subprocess.Popen] = (),
) -> None:
    """Poll `ready` until it holds; fail early, with the log tails, when a daemon exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        dead = [proc for proc in procs if proc.poll() is not None]
        if dead:
            reason = f"failed: {dead[0].args[0]} exited with status {dead[0].returncode}"
            break
        time.sleep(0.2)
    else:
        reason = f"not ready after {timeout_s:.0f} s"
    tails = "\n".join(_tail(p) for p in logs)
    raise ClusterError(f"{what} {reason}\n{tails}")


def _run(
    argv: Sequence[str], cfg: ClusterConfig, check: bool = True
) -> subprocess.CompletedProcess:
    result = subprocess.run(
        argv, env=cfg.env(), capture_output=True, text=True, timeout=60, check=False
    )
    if check and result.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed ({result.returncode}):\n{result.stderr}")
    return result


def _succeeds(argv: Sequence[str], cfg: ClusterConfig) -> bool:
    try:
        return _run(argv, cfg, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


# ---------------------------------------------------------------- the daemons, in start order


def _munge_works() -> bool:
    encode = subprocess.run(["munge", "-n"], capture_output=True, check=False)
    if encode.returncode != 0:
        return False
    decode = subprocess.run(["unmunge"], input=encode.stdout, capture_output=True, check=False)
    return decode.returncode == 0


def _start_munge(cfg: ClusterConfig) -> None:
    """Use a running munged if there is one; else start the system one (it runs as `munge`)."""
    if _munge_works():
        return
    if not MUNGE_KEY.exists():
        subprocess.run(["mungekey", "--create", f"--keyfile={MUNGE_KEY}"], check=True)
    # munged refuses a key or directories that others could read or write.
    for directory, mode in (
        (MUNGE_KEY.parent, 0o700),
        (MUNGE_RUN_DIR, 0o755),
        (Path("/var/lib/munge"), 0o711),
        (Path("/var/log/munge"), 0o700),
    ):
        directory.mkdir(parents=True, exist_ok=True)
        shutil.chown(directory, "munge", "munge")
        directory.chmod(mode)
    shutil.chown(MUNGE_KEY, "munge", "munge")
    MUNGE_KEY.chmod(0o400)
    log = cfg.log_dir / "munged.log"
    log.touch()
    shutil.chown(log, "munge", "munge")
    started = subprocess.run(
        ["runuser", "-u", "munge", "--", "munged", f"--log-file={log}"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if started.returncode != 0:
        raise ClusterError(f"munged failed to start: {started.stderr}\n{_tail(log)}")
    _wait_for(_munge_works, "munged", [log], timeout_s=10)
    # munged forks into the background; remember its pid so `stop` ends only what we started.
    pid = _read_pid(MUNGE_RUN_DIR / "munged.pid")
    if pid is not None:
        (cfg.run_dir / "munged.pid").write_text(f"{pid}\n")


def _sql(cfg: ClusterConfig, statement: str) -> None:
    _run(["mariadb", f"--defaults-file={cfg.etc_dir / 'my.cnf'}", "-e", statement], cfg)


def _start_mariadb(cfg: ClusterConfig) -> None:
    my_cnf = f"--defaults-file={cfg.etc_dir / 'my.cnf'}"
    log = cfg.log_dir / "mariadb.log"
    if not (cfg.mysql_dir / "mysql").is_dir():
        shutil.rmtree(cfg.mysql_dir, ignore_errors=True)
        _run(
            ["mariadb-install-db", my_cnf, "--user=root", "--skip-test-db",
             "--auth-root-authentication-method=socket"],
            cfg,
        )  # fmt: skip
    proc = _spawn(cfg, "mariadb", ["mariadbd", my_cnf])
    ping = ["mariadb", my_cnf, "-e", "SELECT 1"]
    _wait_for(lambda: _succeeds(ping, cfg), "MariaDB", [log], timeout_s=60, procs=[proc])
    user = f"'{cfg.db_user}'@'127.0.0.1'"
    _sql(
        cfg,
        f"CREATE DATABASE IF NOT EXISTS {cfg.db_name};"
        f"CREATE USER IF NOT EXISTS {user} IDENTIFIED BY '{cfg.db_password}';"
        f"GRANT ALL ON {cfg.db_name}.* TO {user};",
    )


def _start_slurmdbd(cfg: ClusterConfig) -> None:
    proc = _spawn(cfg, "slurmdbd", ["slurmdbd", "-D"])
    logs = [cfg.log_dir / "slurmdbd.log", cfg.log_dir / "slurmdbd.out"]
    clusters = ["sacctmgr", "-n", "-P", "show", "cluster", "format=cluster"]
    _wait_for(lambda: _succeeds(clusters, cfg), "slurmdbd", logs, timeout_s=60, procs=[proc])
    # slurmctld only reports to the database for a cluster it already knows.
    if cfg.cluster_name not in _run(clusters, cfg).stdout.split():
        _run(["sacctmgr", "-i", "add", "cluster", cfg.cluster_name], cfg)


def _start_slurmctld(cfg: ClusterConfig) -> None:
    proc = _spawn(cfg, "slurmctld", ["slurmctld", "-D"])
    logs = [cfg.log_dir / "slurmctld.log", cfg.log_dir / "slurmctld.out"]
    ping = ["scontrol", "ping"]
    _wait_for(
        lambda: "UP" in _run(ping, cfg, check=False).stdout,
        "slurmctld", logs, timeout_s=60, procs=[proc],
    )  # fmt: skip


def node_states(cfg: ClusterConfig) -> dict[str, str]:
    """Node name -> Slurm state (lower case; `*` marks a node not responding)."""
    result = _run(["sinfo", "-h", "-N", "-p", cfg.partition, "-o", "%N %T"], cfg, check=False)
    if result.returncode != 0:
        return {}
    return dict(line.split() for line in result.stdout.splitlines() if line.strip())


def _nodes_up(cfg: ClusterConfig) -> bool:
    states = node_states(cfg)
    return all(states.get(name) in NODE_UP_STATES for name in cfg.node_names)


def _start_slurmds(cfg: ClusterConfig) -> None:
    procs = [_spawn(cfg, f"slurmd-{name}", ["slurmd", "-D", "-N", name]) for name in cfg.node_names]
    logs = [cfg.log_dir / "slurmctld.log"]
    for name in cfg.node_names:
        logs += [cfg.log_dir / f"slurmd-{name}.log", cfg.log_dir / f"slurmd-{name}.out"]

    what = f"nodes {','.join(cfg.node_names)} idle"
    _wait_for(lambda: _nodes_up(cfg), what, logs, timeout_s=60, procs=procs)


# slurm.conf must name the slurmdbd before `sacctmgr add cluster`; slurmctld needs the cluster in
# the database; slurmd registers with slurmctld.
STARTUP_ORDER = (_start_munge, _start_mariadb, _start_slurmdbd, _start_slurmctld, _start_slurmds)

# ---------------------------------------------------------------- public API


def missing_requirements() -> str | None:
    """Why this machine cannot run the cluster, or None if it can."""
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root (it starts munged, MariaDB and Slurm daemons)"
    missing = [p for p in REQUIRED_PROGRAMS if shutil.which(p) is None]
    if missing:
        return f"missing programs {', '.join(missing)}; install them with: {APT_INSTALL}"
    return None


def _daemon_pids(cfg: ClusterConfig) -> dict[str, tuple[str, int | None]]:
    """Daemon name -> (program, pid from its pid file), in stop order."""
    names = [("slurmctld", "slurmctld")]
    # Every slurmd that has a pid file, including nodes of an earlier, larger configuration.
    names += [(path.stem, "slurmd") for path in sorted(cfg.run_dir.glob("slurmd-*.pid"))]
    names += [("slurmdbd", "slurmdbd"), ("mariadb", "mariadbd"), ("munged", "munged")]
    return {name: (program, _read_pid(cfg.run_dir / f"{name}.pid")) for name, program in names}


def _daemons_alive(cfg: ClusterConfig) -> dict[str, bool]:
    return {
        name: pid is not None and _pid_alive(pid, program)
        for name, (program, pid) in _daemon_pids(cfg).items()
    }


def status(cfg: ClusterConfig) -> dict[str, object]:
    daemons = _daemons_alive(cfg)
    # Without slurmctld, sinfo would retry for MessageTimeout before giving up.
    nodes = node_states(cfg) if daemons["slurmctld"] else {}
    return {"root": str(cfg.root), "daemons": daemons, "nodes": nodes}


def _running_as_configured(cfg: ClusterConfig) -> bool:
    if not cfg.slurm_conf.exists() or cfg.slurm_conf.read_text() != render_slurm_conf(cfg):
        return False
    daemons = _daemons_alive(cfg)
    del daemons["munged"]  # munge may be the system's own daemon: checked by use instead
    return all(daemons.values()) and _munge_works() and _nodes_up(cfg)


def info(cfg: ClusterConfig, startup_s: float | None = None) -> ClusterInfo:
    return ClusterInfo(
        cluster_name=cfg.cluster_name,
        partition=cfg.partition,
        nodes=cfg.node_names,
        node_addrs={name: "127.0.0.1" for name in cfg.node_names},
        root=cfg.root,
        slurm_conf=cfg.slurm_conf,
        log_dir=cfg.log_dir,
        spool_dir=cfg.spool_dir,
        state_dir=cfg.state_dir,
        started_here=startup_s is not None,
        startup_s=startup_s or 0.0,
    )


def start(cfg: ClusterConfig) -> ClusterInfo:
    """Start every daemon and wait until all nodes are idle. Already running as configured:
    a no-op; running otherwise (other node count, a dead daemon): a clean restart."""
    problem = missing_requirements()
    if problem:
        raise ClusterError(problem)
    if _running_as_configured(cfg):
        return info(cfg)
    began = time.monotonic()
    stop(cfg)
    _write_configs(cfg)
    try:
        for start_daemon in STARTUP_ORDER:
            start_daemon(cfg)
    except BaseException:
        stop(cfg)  # no half-started cluster left behind; the logs stay for the error message
        raise
    return info(cfg, startup_s=time.monotonic() - began)


def _cancel_jobs(cfg: ClusterConfig, timeout_s: float = 20.0) -> None:
    """Cancel every job so no slurmstepd outlives its slurmd."""
    queue = ["squeue", "-h", "-o", "%i"]
    jobs = _run(queue, cfg, check=False).stdout.split()
    if not jobs:
        return
    _run(["scancel", *jobs], cfg, check=False)
    deadline = time.monotonic() + timeout_s
    while _run(queue, cfg, check=False).stdout.split() and time.monotonic() < deadline:
        time.sleep(0.5)


def stop(cfg: ClusterConfig, purge: bool = False) -> None:
    """Stop every daemon this helper started and remove their pid files. `purge` also deletes
    the whole state directory (job state, accounting database, logs)."""
    pids = _daemon_pids(cfg)
    ctld_program, ctld_pid = pids["slurmctld"]
    if ctld_pid is not None and _pid_alive(ctld_pid, ctld_program) and cfg.slurm_conf.exists():
        _cancel_jobs(cfg)
    for name, (program, pid) in pids.items():
        if pid is not None:
            _stop_pid(pid, program)
        (cfg.run_dir / f"{name}.pid").unlink(missing_ok=True)
    if purge:
        shutil.rmtree(cfg.root, ignore_errors=True)


# ---------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m slurm.local_cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=("start", "stop", "status"))
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument(
        "--root", type=Path, default=None, help=f"default: $K3_SLURM_DIR or {DEFAULT_ROOT}"
    )
    parser.add_argument("--purge", action="store_true", help="stop: also delete the state dir")
    args = parser.parse_args(argv)
    cfg = ClusterConfig(nodes=args.nodes, **({"root": args.root} if args.root else {}))
    if args.command == "start":
        try:
            cluster = start(cfg)
        except ClusterError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        took = (
            f"started in {cluster.startup_s:.1f} s" if cluster.started_here else "already running"
        )
        print(f"Slurm cluster {cluster.cluster_name} {took}: nodes {', '.join(cluster.nodes)}")
        print(f"export SLURM_CONF={cluster.slurm_conf}")
    elif args.command == "stop":
        stop(cfg, purge=args.purge)
    else:
        print(json.dumps(status(cfg), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
