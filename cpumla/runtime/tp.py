"""Tensor-parallel ranks: one model split over several processes, each holding its slice of every large
weight (models/shard.py), on one machine or several.

Every rank runs the same command. Ranks come either from torchrun (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT in the environment) or from `--tp N` / `cpumla.load(tp=N)`, which starts ranks 1 .. N-1 as
processes of its own (`python -m cpumla.runtime.tp_rank`, the load() arguments in CPUMLA_TP_LOAD), one
slice of the CPUs each (one NUMA node each where there are enough, through numactl when it is
installed). They meet over torch.distributed (gloo) and check that they agree (start()). Then:

- rank 0 talks to the user and samples; its engine's model is a Leader, which sends each forward's
  command (token ids, position, which outputs) to the others before running its own part;
- the other ranks follow (follow()): they run each command with their slice and exit when rank 0
  closes, exits or fails;
- inside a forward the ranks all-reduce twice a layer and gather the logits on rank 0: through
  shared memory when every rank is on this machine (native/comm.py ShmComm), else gloo (GlooComm).

A rank that exits or fails ends every rank's next wait with one line naming it; one that hangs, after
CPUMLA_TP_TIMEOUT seconds (default 60). A rank waiting for its next command has no time limit; ranks
waiting for each other to start and load wait up to START_SECONDS."""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import numpy as np

from cpumla.errors import CpumlaError
from cpumla.models.shard import Shard
from cpumla.native.comm import GlooComm, ShmComm

LOAD_ENV = "CPUMLA_TP_LOAD"          # the load() arguments of a rank started by --tp (JSON)
HEADER = 64                          # int64 words of a command; up to HEADER - 8 token ids ride in it
STOP, FORWARD, HIDDEN, MTP, PROBE = range(5)
# how long the ranks wait for each other to start and to load (a large model from disk takes minutes)
START_SECONDS = 1800


def timeout() -> float:
    try:
        t = float(os.environ.get("CPUMLA_TP_TIMEOUT", "60"))
    except ValueError:
        raise CpumlaError(f"CPUMLA_TP_TIMEOUT must be a number of seconds, got {os.environ['CPUMLA_TP_TIMEOUT']!r}") from None
    if not t > 0:
        raise CpumlaError("CPUMLA_TP_TIMEOUT must be positive")
    return t


def check_tp(tp) -> None:
    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= 64):
        raise CpumlaError(f"tp must be a number of ranks from 1 to 64, got {tp!r}")


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name) or default)
    except ValueError:
        raise CpumlaError(f"{name} must be an integer, got {os.environ[name]!r}") from None


def launch_world() -> int:
    """The ranks of the torchrun launch this process belongs to (WORLD_SIZE), 1 outside one."""
    return _env_int("WORLD_SIZE", 1)


def default_tp(tp):
    """tp checked, or CPUMLA_TP's (what `--tp` sets for the command it runs) when tp is None."""
    if tp is None and os.environ.get("CPUMLA_TP"):
        try:
            tp = int(os.environ["CPUMLA_TP"])
        except ValueError:
            raise CpumlaError(f"CPUMLA_TP must be a number of ranks, got {os.environ['CPUMLA_TP']!r}") from None
    check_tp(tp)
    return tp


def numa_nodes() -> list[list[int]]:
    """The CPUs of each NUMA node with CPUs (sysfs), [] where that is unknown."""
    nodes = []
    for d in sorted(Path("/sys/devices/system/node").glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            text = (d / "cpulist").read_text().strip()
        except OSError:
            continue
        cpus = []
        for part in filter(None, text.split(",")):
            a, _, b = part.partition("-")
            cpus.extend(range(int(a), int(b or a) + 1))
        if cpus:
            nodes.append(cpus)
    return nodes


def placement(world: int) -> list[tuple[int | None, list[int]]]:
    """(NUMA node or None, CPUs) of each local rank: a node each where there are as many nodes as ranks,
    else an equal slice of this process's CPUs each."""
    nodes = numa_nodes()
    if len(nodes) >= world > 1:
        return [(r, nodes[r]) for r in range(world)]
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    per = max(1, len(cpus) // world)
    return [(None, cpus[r * per:(r + 1) * per] or cpus) for r in range(world)]


class Ranks:
    """This process's place among the ranks: rank, world, shard, and once connected, comm."""

    def __init__(self, rank: int, world: int, children: list):
        self.rank, self.world = rank, world
        self.shard = Shard(rank, world)
        self.children = children          # rank 0 of --tp: the processes it started
        self.comm = None
        self.local = True
        self.agreed = False                # agree() ran: every rank knows how the start went
        self._commands = None
        self.restore = None                # rank 0 of --tp: what close() gives back to this process
                                           # (its CPUs and the library's threads before the ranks)

    # ---- agreement ----
    def gather(self, obj) -> list:
        import torch.distributed as dist

        out = [None] * self.world
        try:
            dist.all_gather_object(out, obj)
        except Exception as e:   # noqa: BLE001 (a peer gone)
            for r, p in enumerate(self.children, 1):
                if p.poll() is not None:
                    raise CpumlaError(f"tensor-parallel rank {r} exited during the start ({exit_text(p.returncode)})") from None
            raise CpumlaError(f"tensor parallel: a rank left during the start: {str(e).splitlines()[0]}") from None
        return out

    def agree(self, status: tuple[str, str]) -> None:
        """status: ("ok", fingerprint) or ("error", one line). Every rank raises when any failed, or
        when their fingerprints (model, config, weights, cpumla version) differ."""
        self.agreed = True
        every = self.gather(status)
        for r, (kind, text) in enumerate(every):
            if kind == "error":
                raise CpumlaError(text if r == self.rank or self.rank != 0 else f"tensor-parallel rank {r}: {text}")
        prints = [text for _, text in every]
        for r, p in enumerate(prints):
            if p != prints[0]:
                raise CpumlaError(f"tensor-parallel rank {r} runs another model, config, weights or cpumla version "
                                  f"than rank 0 (fingerprint {p[:12]} against {prints[0][:12]})")
        hosts = self.gather(socket.gethostname())
        self.local = len(set(hosts)) == 1 and os.environ.get("CPUMLA_TP_COMM", "shm") != "gloo"

    def connect(self):
        """The communicator: shared memory when every rank is on this machine, else gloo."""
        import torch.distributed as dist

        self._commands = dist.new_group(backend="gloo", timeout=timedelta(days=3650))
        ops = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout()))
        if not self.local:
            self.comm = GlooComm(self._commands, ops)
            return self.comm
        path = [ShmComm.create(self.world) if self.rank == 0 else None]
        dist.broadcast_object_list(path, src=0)
        try:
            self.comm = ShmComm(path[0], self.rank, self.world, timeout())
            dist.barrier()
        finally:
            if self.rank == 0:
                Path(path[0]).unlink(missing_ok=True)
        return self.comm

    def close(self) -> None:
        """Rank 0: tells the others to stop, then reaps the processes it started."""
        comm, self.comm = self.comm, None
        if comm is not None and self.rank == 0:
            try:
                comm.broadcast(np.zeros(HEADER, np.int64), command=True)        # STOP
            except CpumlaError:
                pass
        for p in self.children:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.children = []
        if self.restore is not None:
            cpus, threads = self.restore
            self.restore = None
            if cpus is not None:
                os.sched_setaffinity(0, cpus)
            from cpumla import native

            native.set_threads(threads)
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:   # noqa: BLE001 (closing: the others may be gone already)
            pass


def exit_text(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        return f"killed by {name}" + (": out of memory?" if code == -signal.SIGKILL else "")
    return f"exit code {code}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world: int, load_args: dict, port: int, where) -> list:
    children = []
    for r in range(1, world):
        node, cpus = where[r]
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CPUMLA_TP_CPUS=",".join(map(str, cpus)),
                   **{LOAD_ENV: json.dumps(load_args)})
        cmd = [sys.executable, "-m", "cpumla.runtime.tp_rank"]
        if node is not None and shutil.which("numactl"):
            cmd = ["numactl", f"--cpunodebind={node}", f"--membind={node}", *cmd]
        # a session of its own: the terminal's Ctrl-C is rank 0's to handle (chat stops an answer and
        # goes on); the ranks stop when rank 0 says so or exits
        children.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         start_new_session=True))
    return children


def _init_group(rank: int, world: int, addr: str, port: str, children: list) -> None:
    """torch.distributed's gloo group; rank 0 of --tp watches its children meanwhile (one that exits
    at its start ends the wait)."""
    import torch.distributed as dist

    err = []

    def run():
        try:
            dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                                    timeout=timedelta(seconds=max(timeout(), START_SECONDS)))
        except Exception as e:   # noqa: BLE001
            err.append(str(e).splitlines()[0] if str(e) else type(e).__name__)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.05)
        for r, p in enumerate(children, 1):
            if p.poll() is not None:
                raise CpumlaError(f"tensor-parallel rank {r} exited at its start ({exit_text(p.returncode)})")
    if err:
        raise CpumlaError(f"tensor parallel: the ranks did not meet at {addr}:{port}: {err[0]}")


def start(tp: int | None, load_args: dict) -> Ranks | None:
    """This process's Ranks (None: one process). Under torchrun (WORLD_SIZE > 1) it joins; with tp > 1
    it starts ranks 1 .. tp-1 with load_args and becomes rank 0."""
    check_tp(tp)
    import torch.distributed as dist

    if dist.is_initialized():
        raise CpumlaError("this process already runs a tensor-parallel model: close it (Engine.close) before "
                          "loading another (under torchrun: one model a launch)")
    world = launch_world()
    if world > 1:
        if tp not in (None, 1, world):
            raise CpumlaError(f"--tp {tp} against the {world} ranks of this launch: leave --tp out under torchrun")
        rank = _env_int("RANK", 0)
        if not 0 <= rank < world:
            raise CpumlaError(f"RANK {rank} is not one of the {world} ranks of this launch (WORLD_SIZE)")
        cpus = os.environ.get("CPUMLA_TP_CPUS")
        if cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])
        ranks = Ranks(rank, world, [])
        _init_group(rank, world, os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT", "29500"), [])
        return ranks
    if not tp or tp == 1:
        return None
    where = placement(tp)
    port = _free_port()
    children = _spawn(tp, load_args, port, where)
    ranks = Ranks(0, tp, children)
    from cpumla import native

    native.ensure_init()
    ranks.restore = (os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None, native.get_threads())
    try:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, where[0][1])
        _init_group(0, tp, "127.0.0.1", str(port), children)
    except BaseException:
        for p in children:
            p.kill()
            p.wait()
        raise
    atexit.register(ranks.close)
    return ranks


def threads_per_rank(world: int) -> int:
    """A rank's threads by default: its slice of the CPUs."""
    return max(1, len(placement(world)[0][1]))


def fingerprint(cfg, resolved, options: dict) -> str:
    """What every rank must share: cpumla's version, the config, the load options and the weights (each
    file's name, size and first 64 KiB; or the dummy weights' seed and format)."""
    from cpumla.native import ffi, lib

    version = ffi.string(lib.cpumla_version()).decode()
    h = hashlib.sha256(json.dumps([version, cfg.to_dict(), options], sort_keys=True, default=str).encode())
    files = []
    if not options.get("dummy_weights") and resolved is not None:
        if resolved.gguf is not None:
            files = [Path(resolved.gguf.path)]
        elif resolved.directory is not None:
            files = sorted(Path(resolved.directory).glob("*.safetensors"))
    for f in files:
        h.update(f.name.encode())
        h.update(str(f.stat().st_size).encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 16))
    return h.hexdigest()


# ---- rank 0 ---------------------------------------------------------------------------------------
class Leader:
    """Rank 0's model: each forward sends its command to the other ranks, then runs this rank's part.
    Anything else is the model's own."""

    def __init__(self, model, ranks: Ranks):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "_h", np.zeros(HEADER, np.int64))

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __setattr__(self, name, value):
        raise CpumlaError(f"tensor-parallel ranks each run a model of their own: {name} cannot be set on rank 0's "
                          "alone once they run")

    def _send(self, op: int, ids: np.ndarray, pos0: int, last_only: bool, has_out=True, has_hidden=False,
              hidden=None) -> None:
        comm, h, n = self.ranks.comm, self._h, ids.size
        if comm is None:
            raise CpumlaError("the tensor-parallel ranks have stopped")
        inline = n <= HEADER - 8
        h[:8] = (op, n, pos0, int(last_only), int(has_out), int(has_hidden), int(inline), 0)
        if inline:
            h[8:8 + n] = ids
        comm.broadcast(h, command=True)
        if not inline:
            comm.broadcast(np.ascontiguousarray(ids, np.int64))
        if hidden is not None:
            comm.broadcast(np.ascontiguousarray(hidden, np.float32))

    def _run(self, fn, *args):
        try:
            fn(*args)
        except CpumlaError:
            err = getattr(self.ranks.comm, "error", None)
            if err:
                raise CpumlaError(err) from None
            raise

    def forward(self, ids, pos0, out, last_only):
        self._send(FORWARD, ids, pos0, last_only)
        self._run(self._model.forward, ids, pos0, out, last_only)

    def forward_hidden(self, ids, pos0, out, last_only, hidden):
        self._send(HIDDEN, ids, pos0, last_only)
        self._run(self._model.forward_hidden, ids, pos0, out, last_only, hidden)

    def mtp_forward(self, ids, pos0, hidden, out, last_only, hidden_out=None):
        self._send(MTP, ids, pos0, last_only, out is not None, hidden_out is not None, hidden=hidden)
        self._run(self._model.mtp_forward, ids, pos0, hidden, out, last_only, hidden_out)

    def probe(self, floats: int, iters: int) -> list[float]:
        """Seconds of each of `iters` all-reduces of `floats` float32 across the ranks."""
        self._send(PROBE, np.zeros(0, np.int64), iters, False, hidden=np.array([floats], np.float32))
        return _probe(self.ranks.comm, floats, iters)

    def close(self) -> None:
        self.ranks.close()
        self._model.close()


def _probe(comm, floats: int, iters: int) -> list[float]:
    buf, out = np.ones(floats, np.float32), []
    for _ in range(iters):
        t = time.perf_counter()
        comm.all_reduce(buf)
        out.append(time.perf_counter() - t)
        buf[:] = 1.0
    return out


# ---- the other ranks ------------------------------------------------------------------------------
def follow(engine, ranks: Ranks) -> None:
    """Runs rank 0's commands on this rank's part of the model until rank 0 stops; never returns."""
    comm, model, cfg = ranks.comm, engine.model, engine.config
    h = np.zeros(HEADER, np.int64)
    out = np.empty((1, cfg.vocab_size), np.float32)
    width = model.mtp_width
    hid = np.empty((1, width), np.float32)
    code = 0
    try:
        while True:
            comm.broadcast(h, command=True)
            op, n, pos0, last_only, has_out, has_hidden, inline = (int(v) for v in h[:7])
            if op == STOP:
                break
            if op == PROBE:
                floats = np.zeros(1, np.float32)
                comm.broadcast(floats)
                _probe(comm, int(floats[0]), pos0)
                continue
            ids = h[8:8 + n].copy() if inline else np.empty(n, np.int64)
            if not inline:
                comm.broadcast(ids)
            rows = 1 if last_only else n
            if out.shape[0] < rows:
                out = np.empty((rows, cfg.vocab_size), np.float32)
            if hid.shape[0] < n:
                hid = np.empty((n, width), np.float32)
            o = out[:rows]
            if op == FORWARD:
                model.forward(ids, pos0, o, bool(last_only))
            elif op == HIDDEN:
                model.forward_hidden(ids, pos0, o, bool(last_only), hid[:n])
            elif op == MTP:
                hidden = np.empty((n, width), np.float32)
                comm.broadcast(hidden)
                model.mtp_forward(ids, pos0, hidden, o if has_out else None, bool(last_only),
                                  hid[:n] if has_hidden else None)
    except CpumlaError as e:
        err = getattr(comm, "error", None) or str(e)
        comm.fail()
        print(f"cpumla: tensor-parallel rank {ranks.rank}: {err}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        comm.fail()
        code = 130
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
