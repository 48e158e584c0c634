"""Ray placement groups: the same grpo.py from one machine to many nodes.

    python grpo.py --num-trainers 2 --num-engines 1 --colocate         # one machine, local Ray
    ray start --head                                                    # node 0
    ray start --address=<node0-ip>:6379                                 # every other node
    python grpo.py --ray-address auto --num-trainers 16 --num-engines 8 # on node 0

What runs where (one bundle = one GPU and its node's CPUs per GPU, or one CPU on a cluster
without GPUs; which, the cluster's resources say, not the driver's own hardware):

    placement group   [bundle 0   ][bundle 1   ] ... [bundle N    ] ... [bundle N+M-1]
    --colocate        trainer 0 +  trainer 1 +       (engines share the trainers' bundles; the HF
                      engine 0     engine 1           engine lives in its trainer's process and
                                                      decodes from its tensors, vLLM sleeps while
                                                      the trainers train)
    otherwise         trainer 0    trainer 1   ...   engine 0     ...   engine M-1

    driver (grpo.py) --prompts--> engines (sharded, results gathered in order)
                     --batch----> trainers (sharded; torch.distributed all-reduce of gradients:
                                  gloo on CPU, NCCL on GPU; the loss uses the global token count;
                                  each steps AdamW on its share of the weights, ZeRO-1: model.py)

    after each step, the weights (--weight-sync):
    collective     trainer 0 ==broadcast, bucket by bucket==> engine 0, engine 1, ...
                   a process group of their own (weight_sync.WeightGroup): NCCL GPU to GPU, gloo on
                   CPU or when an engine shares its trainer's GPU; bf16, <= 256 MB per bucket
    object-store   trainer 0 --state dict--> Ray object store --> every engine pulls a copy
    (in place)     a colocated HF engine decodes from its trainer's tensors: nothing to send

Where Ray placed each worker (its node's id, host and IP) is printed at start (Cluster.placement).
A worker that fails ends the run with one line (_failure): the exception it raised, or the worker
that died and its node -- a node lost mid-run is named as such, and the run goes on from its last
checkpoint with --resume auto on the nodes left.

This file knows nothing about GRPO: it places actors, runs the functions it is given on them, and
turns Ray's failures into messages that say what to change. It never imports grpo.py or dpo.py.
"""

import dataclasses
import errno
import os
import signal
import socket
import threading
import time
import weakref
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from stopping import asked


# How long a failed call waits for the rest of Ray's news: a collective's other ranks fail as soon
# as a peer is gone (gloo: "Connection closed by peer"), before Ray reports which peer; and a
# worker whose connection broke (ActorUnavailableError) is declared dead once its raylet reports
# the process's exit, or once its node misses Ray's health checks (5, 3 s apart, by default:
# ~15 s; up to a minute where each check times out).
PEER_WAIT_S = 10.0
VERDICT_WAIT_S = 60.0

# What a write that found no room raises: a full disk, a full quota, a file-size limit (and
# checkpoint.written's torch.save failure, which names no errno: EIO).
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)


@dataclasses.dataclass
class Placed:
    """Who a worker is and where Ray placed it."""
    who: str  # "trainer rank 1", "engine 0", "trainer rank 0 + engine 0"
    node: str  # its node's Ray id
    host: str
    ip: str
    pid: int
    handle: weakref.ref  # the worker (a weak reference: this table must not keep it alive)


# Every worker this driver placed, by Ray actor id: the table a run prints at start, and the names
# in the line a lost worker ends the run with.
PLACED: dict[str, Placed] = {}


def _get(refs, what: str):
    """ray.get that turns a failing worker into one line instead of a hang or a wall of Ray
    internals (_failure). A worker's disk that is full, or a file-size limit it met (a
    checkpoint it could not write), is the driver's to name: that OSError is raised here as it
    is. Any other (a model's folder missing on the worker's node) is the worker's failure."""
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, OSError) and e.cause.errno in DISK_FULL:  # (named by session.
            raise e.cause from None                                       # write_checkpoint)
        raise SystemExit(_failure(e, refs, what)) from None
    except ray.exceptions.RayActorError as e:
        if asked():  # (killed with the run: a scheduler's SIGKILL, Ray's own processes gone)
            a = "an" if what[0] in "aeiou" else "a"
            raise SystemExit(f"error: {a} {what} worker ended after the run's signal {asked()}, "
                             f"before the step under way did: that step is lost; the last "
                             f"checkpoint in --out is whole: resume with --resume auto") from None
        raise SystemExit(_failure(e, refs, what)) from None


def _failure(e, refs, what: str) -> str:
    """The line a failed call (refs: a ref or a list of them) ends the run with: a worker lost
    with its node, a worker that died or stopped answering, or the exception a worker raised."""
    died = e if isinstance(e, ray.exceptions.RayActorError) else _died_among(refs)
    if died is not None:
        died = _verdict(died)
    place = PLACED.get(getattr(died, "actor_id", None))
    dead_nodes = {n["NodeID"]: n.get("DeathReasonMessage", "") for n in ray.nodes()
                  if not n["Alive"]}
    if place is None or place.node not in dead_nodes:  # (a peer lost with its node, say)
        place = next((p for p in PLACED.values() if p.handle() and p.node in dead_nodes), place)
    if place is not None and place.node in dead_nodes:
        return (f"error: {place.who} was lost with its node {place.node} on {place.host} "
                f"({place.ip}), which left the Ray cluster ({dead_nodes[place.node] or 'dead'}); "
                f"the checkpoints in --out are whole: go on with --resume auto, on the nodes left "
                f"(as many --num-trainers and --num-engines as they hold) or in one process")
    a = "an" if what[0] in "aeiou" else "a"
    if died is None:  # an exception in the function itself: its traceback says where
        return f"error: {a} {what} worker failed:\n{e}"
    where = (f" ({place.who}, pid {place.pid}, node {place.node} on {place.host} "
             f"({place.ip}))" if place else "")
    if isinstance(died, ray.exceptions.ActorUnavailableError):  # (no verdict in time)
        return (f"error: {a} {what} worker stopped answering{where}: {_reason(died)}; is its "
                f"node cut off from the Ray cluster? The checkpoints in --out are whole: go on "
                f"with --resume auto")
    return (f"error: {a} {what} worker died{where}: {_reason(died)}; the usual cause is memory: "
            f"every worker holds its own model copy; try fewer --num-trainers/--num-engines or "
            f"--colocate")


def _died_among(refs, wait: float = PEER_WAIT_S):
    """The RayActorError of a worker of this call that died, given `wait` seconds to say so;
    None if none did."""
    refs = refs if isinstance(refs, list) else [refs]
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=wait)
    for ref in done:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as e:
            return e
        except ray.exceptions.RayError:
            pass
    return None


def _verdict(e, wait: float = VERDICT_WAIT_S):
    """Ray's word on a worker whose connection broke (ActorUnavailableError): asked again until
    Ray declares it dead (ActorDiedError), for at most `wait` seconds."""
    place = PLACED.get(e.actor_id)
    worker = place.handle() if place else None
    deadline = time.monotonic() + wait
    while isinstance(e, ray.exceptions.ActorUnavailableError) and worker is not None and \
            time.monotonic() < deadline:
        try:
            ray.get(worker.where.remote(), timeout=5)
            break  # it answers again (its call is lost all the same)
        except ray.exceptions.RayActorError as again:
            e = again
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.5)
    return e


def _reason(e) -> str:
    """What Ray says of a dead worker, on one line: its message less the worker's particulars
    (tab-indented lines) and the generic first line."""
    lines = str(e).splitlines()
    told = " ".join(line.strip() for line in lines[1:] if not line.startswith("\t")) or lines[0]
    return told.rstrip(".")


class Cluster:
    """A Ray placement group sized for `num_trainers` trainers and `num_engines` engines."""

    def __init__(self, num_trainers: int, num_engines: int, *, colocate: bool = False,
                 address: str = "", timeout: float = 60.0):
        repo = str(Path(__file__).resolve().parent)
        if not ray.is_initialized():  # (a process running several runs: the last one's are gone)
            PLACED.clear()
        # Workers import grpo/rollout/model from this folder, on every node.
        ray.init(address=None if address in ("", "local") else address, ignore_reinit_error=True,
                 log_to_driver=True,
                 runtime_env={"env_vars": {"PYTHONPATH": repo}}, include_dashboard=False)
        # GPUs or CPUs: what the cluster has, not this process (a driver on a CPU-only head node
        # once gave GPU workers CPU bundles, and they trained on the CPU)
        self.use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        if self.use_gpu and not _has_gpu():
            print(f"note: the driver sees no GPU, the Ray cluster has "
                  f"{ray.cluster_resources()['GPU']:g}: the workers train on GPUs, but what the "
                  f"driver chose from its own hardware (--dtype auto, --rollout auto, the memory "
                  f"settings a GPU's plan would choose) was chosen for a CPU; pass them yourself "
                  f"or start the run on a GPU node")
        elif not self.use_gpu and _has_gpu():
            print("note: the driver has a GPU, the Ray cluster none: the workers train on CPUs, "
                  "but what the driver chose from its own hardware (--dtype auto, --rollout auto, "
                  "the memory plan's settings) was chosen for a GPU; pass them yourself, or wait "
                  "for the cluster's GPU nodes")
        self.colocate = colocate
        self.num_trainers, self.num_engines = num_trainers, num_engines
        n = max(num_trainers, num_engines) if colocate else num_trainers + num_engines
        kind = "GPU" if self.use_gpu else "CPU"
        # A GPU bundle holds its share of the node's CPUs, for its workers' threads (Worker)
        self.bundle_cpus = cpus_per_gpu(ray.nodes()) if self.use_gpu else 1
        bundle = {"GPU": 1, "CPU": self.bundle_cpus} if self.use_gpu else {"CPU": 1}
        have = ray.cluster_resources().get(kind, 0)
        if have < n:  # infeasible: Ray would wait forever, so say so now
            raise SystemExit(
                f"error: --num-trainers {num_trainers} --num-engines {num_engines}"
                f"{' --colocate' if colocate else ''} needs {n} {kind} bundles; the Ray cluster "
                f"has {have:g} {kind}s. Use fewer workers, --colocate (engines share the "
                f"trainers' {kind}s), or add nodes with `ray start --address=...`.")
        # PACK: the bundles on as few nodes as hold them (trainers close to each other for their
        # all-reduce), spread over more where one node cannot hold them all
        self.pg = placement_group([bundle] * n, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            raise SystemExit(f"error: {n} {kind} bundles could not be reserved within "
                             f"{timeout:.0f} s (busy cluster?): {ray.available_resources()}")

    def _options(self, bundle: int):
        share = 0.5 if self.colocate else 1.0  # colocated trainer and engine split their bundle
        resources = {"num_cpus": share * self.bundle_cpus}
        if self.use_gpu:
            resources["num_gpus"] = share
        strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                    placement_group_bundle_index=bundle)
        return dict(scheduling_strategy=strategy, **resources)

    def trainers(self, setup, *args) -> "TrainerGroup":
        """num_trainers workers joined in one torch.distributed group, each running setup(*args)."""
        workers = [Worker.options(**self._options(i)).remote() for i in range(self.num_trainers)]
        _register(workers, [f"trainer rank {rank}" for rank in range(self.num_trainers)], "trainer")
        addr, port = _get(workers[0].address.remote(), "trainer")
        backend = "nccl" if self.use_gpu else "gloo"
        _get([w.init_process_group.remote(backend, addr, port, rank, self.num_trainers)
              for rank, w in enumerate(workers)], "trainer")
        _get([w.setup.remote(setup, *args) for w in workers], "trainer")
        return TrainerGroup(workers)

    def engines(self, setup, *args) -> "EngineGroup":
        """num_engines workers, each holding the rollout engine that setup(*args) returns."""
        first = 0 if self.colocate else self.num_trainers
        workers = [Worker.options(**self._options(first + i)).remote()
                   for i in range(self.num_engines)]
        _register(workers, [f"engine {i}" for i in range(self.num_engines)], "engine")
        _get([w.setup.remote(setup, *args) for w in workers], "engine")
        return EngineGroup(workers)

    def engines_in(self, trainers: "TrainerGroup", setup, *args) -> "EngineGroup":
        """num_engines engines (no more than trainers), engine i in trainer i's process:
        setup(trainer_state, *args) returns it."""
        workers = trainers.workers[:self.num_engines]
        for i, place in enumerate(_placed(workers)):
            place.who = f"{place.who.split(' + ')[0]} + engine {i}"
        _get([w.attach.remote(setup, *args) for w in workers], "trainer")
        return EngineGroup(workers, on="engine")

    def placement(self) -> str:
        """Where Ray placed each worker: a line each, with its node's id, host and IP, and its
        pid (the workers this driver holds)."""
        placed = [p for p in PLACED.values() if p.handle() is not None]
        nodes, width = len({p.node for p in placed}), max(len(p.who) for p in placed)
        return "\n".join([f"Ray placed the workers on {nodes} node{'s' if nodes > 1 else ''}:"] +
                         [f"  {p.who:<{width}}  node {p.node} on {p.host} ({p.ip})  pid {p.pid}"
                          for p in placed])

    def shutdown(self):
        remove_placement_group(self.pg)
        ray.shutdown()


def _register(workers, names: list[str], what: str):
    """Note who each new worker is and where Ray placed it (PLACED)."""
    for worker, who, (actor, node, host, ip, pid) in zip(
            workers, names, _get([w.where.remote() for w in workers], what)):
        PLACED[actor] = Placed(who, node, host, ip, pid, weakref.ref(worker))


def _placed(workers) -> list[Placed]:
    return [next(p for p in PLACED.values() if p.handle() is w) for w in workers]


@ray.remote
class Worker:
    """A process in a bundle: holds whatever setup() built, runs functions on it."""

    def where(self):
        """(Ray actor id, node id, host, IP, pid): who and where this worker is."""
        context = ray.get_runtime_context()
        return (context.get_actor_id(), context.get_node_id(), socket.gethostname(),
                ray.util.get_node_ip_address(), os.getpid())

    def address(self):
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    group = None  # the trainers' process group, on trainer workers

    def __init__(self):
        # As many threads as the CPUs this worker holds (its share of its bundle's): not every
        # core of the node, which each worker of a GPU node would take (inside one, the node's
        # GPUs are one visible device), nor one, what Ray's OMP_NUM_THREADS says for a fraction.
        import torch
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
        torch.set_num_threads(max(1, int(cpus)))
        # A scheduler that signals every process of the job (SLURM's preemption) would end the
        # worker in the middle of the driver's step: the driver alone decides when its workers
        # stop (stopping.py), and Ray ends them with the run. (Ctrl-C never reaches them: Ray
        # gives each a process group of its own, and blocks SIGINT in it.)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def init_process_group(self, backend, addr, port, rank, world_size):
        import torch.distributed as dist
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        self.group = dist.group.WORLD  # this process holds a trainer and nothing else

    def setup(self, fn, *args):
        """state = fn(*args), given group= the trainers' process group on a trainer worker."""
        self.state = fn(*args, group=self.group) if self.group is not None else fn(*args)

    def attach(self, fn, *args):
        """engine = fn(state, *args): a second tenant built from the first (a colocated engine
        that decodes from its trainer's own tensors)."""
        self.engine = fn(self.state, *args)

    def run(self, fn, *args, on: str = "state"):
        return fn(getattr(self, on), *args)


def shard(n: int, parts: int) -> list[range]:
    """Contiguous, near-equal index ranges: results concatenate back in order."""
    bounds = [n * i // parts for i in range(parts + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(parts)]


class TrainerGroup:
    def __init__(self, workers):
        self.workers = workers

    def run(self, fn, per_rank_args: list[tuple]) -> list:
        """fn(state, *per_rank_args[rank]) on every trainer, concurrently (they all-reduce)."""
        return _get([w.run.remote(fn, *args) for w, args in zip(self.workers, per_rank_args)],
                    "trainer")

    def run_rank0(self, fn, *args):
        return _get(self.workers[0].run.remote(fn, *args), "trainer")

    def submit(self, fn, per_rank_args: list[tuple]) -> list:
        """Like run, without waiting: the refs, for gather() (with the engines' work)."""
        return [w.run.remote(fn, *args) for w, args in zip(self.workers, per_rank_args)]

    def check_shared_folder(self, folder: str, sees=None):
        """Stop now if a trainer cannot see `folder` (the driver's --out): rank 0 writes the
        checkpoints and the model there and every rank reads a checkpoint back on --resume, so
        on several nodes it must be one shared filesystem. sees(state, path): (node, visible?)."""
        probe = Path(folder) / f".shared-check-{os.getpid()}-{time.time_ns()}"
        probe.write_text("written by the driver\n")
        try:
            seen = self.run(sees or _sees, [(str(probe),)] * len(self.workers))
        finally:
            probe.unlink()
        for rank, (node, visible) in enumerate(seen):
            if not visible:
                raise SystemExit(f"error: --out {folder} is not visible from trainer rank {rank} "
                                 f"on node {node}: on several nodes --out must be a shared "
                                 f"filesystem (NFS, a cluster mount), the same path everywhere")

    def address(self) -> tuple[str, int]:
        """Rank 0's node address and a free port there (for a process group it leads)."""
        return _get(self.workers[0].address.remote(), "trainer")

    def weights_ref(self, get_weights) -> "ray.ObjectRef":
        """The weights, put in the object store by rank 0 itself (they never pass through the
        driver). get_weights(state) runs on every rank -- sharded weights are gathered
        collectively -- and returns them on rank 0, None elsewhere."""
        return self.run(_put_state_dict, [(get_weights,)] * len(self.workers))[0][0]


def _sees(state, path: str) -> tuple[str, bool]:
    return ray.util.get_node_ip_address(), Path(path).exists()


def _put_state_dict(state, get_weights):
    weights = get_weights(state)
    if weights is None:
        return [None]
    weights = {k: v.detach().cpu() for k, v in  # (a state dict, or (name, tensor) pairs)
               (weights.items() if isinstance(weights, dict) else weights)}
    return [ray.put(weights)]  # a ref inside a list stays a ref when it crosses to the driver


def _generate(engine, prompt_ids, n, sampling):
    return engine.generate(prompt_ids, n, sampling)


def _shard_sampling(sampling, first: int):
    """Each engine seeds its shard by where it starts in the batch: engines given one seed would
    draw the same random numbers for their first prompts, and their second, ... (The first shard
    keeps the seed: one engine on Ray samples what one in the driver's process does.)"""
    if sampling.seed is None or first == 0:
        return sampling
    from sampling import request_seed
    return dataclasses.replace(sampling, seed=request_seed(sampling.seed, first))


def _update(engine, state, version):
    return engine.update_weights(state, version)


def _max_model_len(engine) -> int:
    return getattr(engine, "max_model_len", 0)


def _decoding(engine):
    return getattr(engine, "decoding", None)


def _decode_as(engine, choice):
    if _decoding(engine) is not None:  # (an HF engine's)
        engine.decoding = choice


def _release_kept(engine):
    release = getattr(engine, "release_kept", None)
    if release:
        release()


def gather(refs: list, what: str = "trainer or engine") -> list:
    """Wait for work submitted to trainers and engines together (say, both ends of a broadcast)."""
    return _get(refs, what)


class Pending:
    """Completions being generated while the driver does something else (--async-steps)."""

    def __init__(self, refs):
        self.refs = refs

    def result(self):
        outs = _get(self.refs, "engine")
        versions = sorted({out.policy_version for out in outs})
        if len(versions) > 1:
            raise SystemExit(f"error: the rollout engines hold the weights of different steps "
                             f"{versions}: a weight sync failed or was skipped")
        return type(outs[0]).concat(outs)  # prompt-major order is kept: shards are contiguous


class EngineGroup:
    """Several rollout engines behind the single-engine interface grpo.py already uses. on: what
    each worker holds the engine as (setup's state, or attach's engine beside a trainer)."""

    def __init__(self, workers, on: str = "state"):
        self.workers, self.on = workers, on

    def generate(self, prompt_ids, n, sampling):
        return self.submit_generate(prompt_ids, n, sampling).result()

    def submit_generate(self, prompt_ids, n, sampling) -> Pending:
        """Start generating on the engines; .result() waits for the completions. An engine works
        through its calls in order: a weight sync sent meanwhile waits for the generation."""
        parts = [r for r in shard(len(prompt_ids), len(self.workers)) if len(r)]
        return Pending([w.run.remote(_generate, [prompt_ids[i] for i in r], n,
                                     _shard_sampling(sampling, r.start), on=self.on)
                        for w, r in zip(self.workers, parts)])

    def release_kept(self):
        """Every engine frees what it kept for continuing calls (episodes' keys and values)."""
        self.run(_release_kept)

    @property
    def decoding(self):
        """The first engine's attention.DecodeChoice (None: vLLM), which the run records."""
        return self.run(_decoding)[0]

    def decode_alike(self):
        """Every engine decodes as the first chose: each timed its own choice when it started (on
        unlike nodes, or beside a busy core, they can differ), and flash or not changes a bf16
        run's samples -- one choice, which the run records and a resumed run keeps."""
        choices = self.run(_decoding)
        modes = [choice.mode for choice in choices if choice is not None]
        if len(set(modes)) > 1:
            print(f"engines: their decoding timed apart ({', '.join(modes)}); all decode as the "
                  f"first chose, {modes[0]}")
            self.run(_decode_as, choices[0])

    @property
    def max_model_len(self) -> int:
        """The longest sequence, prompt included, every engine holds (vLLM's max_model_len; 0:
        no limit, the HF engine's): episodes end within it (env.Agent.budget)."""
        return min(self.run(_max_model_len))

    def run(self, fn, *args) -> list:
        """fn(engine, *args) on every engine, e.g. to inspect them."""
        return _get(self.submit(fn, [args] * len(self.workers)), "engine")

    def submit(self, fn, per_engine_args: list[tuple]) -> list:
        """fn(engine, *per_engine_args[i]) on engine i, without waiting: the refs."""
        return [w.run.remote(fn, *args, on=self.on)
                for w, args in zip(self.workers, per_engine_args)]

    def update_weights(self, state, version: int = 0) -> float:
        """Broadcast a state dict (or an object ref to one) to every engine through the object
        store; returns the wall time of the whole broadcast."""
        t0 = time.perf_counter()
        ref = state if isinstance(state, ray.ObjectRef) else ray.put(state)
        _get([w.run.remote(_update, ref, version, on=self.on) for w in self.workers], "engine")
        return time.perf_counter() - t0


def cpus_per_gpu(nodes: list[dict]) -> int:
    """The CPUs a GPU bundle holds: the fewest per GPU on any live node with GPUs (ray.nodes()'s
    records), so that every such node fits a bundle for each of its GPUs -- none where a node has
    fewer CPUs than GPUs (its workers then compute on one thread)."""
    shares = [n["Resources"].get("CPU", 0) // n["Resources"]["GPU"] for n in nodes
              if n.get("Alive", True) and n["Resources"].get("GPU", 0) > 0]
    return int(min(shares, default=1))


def _has_gpu() -> bool:
    import torch
    return torch.cuda.is_available()
