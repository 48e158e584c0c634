"""Weights from the trainers to the engines, after every step: the engines then sample from the
policy the trainers just updated. Every engine takes the step's number with its weights and says
it with each batch of completions (sampling.policy_lag stops a run whose sync went missing).

    one process (trainer.setup_local)   engine.update_weights(weights_of(trainer)): the HF engine
                                        copies them tensor by tensor, or samples from the trainer's
                                        own tensors and has nothing to copy; vLLM loads them in
    Ray, by a collective (default)      trainer rank 0 broadcasts them to every engine, one bucket
                                        at a time (weight_layout, WeightGroup), in the engines'
                                        dtype: weight_sync_by_collective
    Ray, by the object store            rank 0 puts them in Ray's object store, every engine pulls
                                        a copy: weight_sync_by_object_store
    Ray, an engine beside its trainer   it samples from the trainer's tensors: weight_sync_in_place

A sharded (FSDP2) model gathers its full weights for every sync: every trainer rank calls these,
rank 0 sends. The vLLM engine takes a broadcast inside the worker that owns its model (WeightSync,
its worker extension).
"""

import functools
import math
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from hardware import DTYPES
from model import full_weights, named_tensors


# ---------------------------------------------------------------------------------------------
# The broadcast: buckets of at most BUCKET_MB in the engines' dtype, under the names the engine's
# loader expects. Neither side ever holds a second full copy for the transfer, and nothing goes
# through Ray's object store.

BUCKET_MB = 256


@dataclass
class WeightSpec:
    """One tensor of a sync: its name (as the engine loads it), shape and dtype."""
    name: str
    shape: tuple
    dtype: str  # a torch dtype's name, e.g. "bfloat16"


def weight_layout(weights, dtype: torch.dtype, bucket_mb: int = BUCKET_MB) -> list[list]:
    """The buckets of WeightSpecs a sync sends, in order: floating tensors cast to `dtype`, each
    bucket of one dtype and at most bucket_mb (a larger tensor goes alone). weights: a state dict
    or full_weights' pairs, in the order send() will take them."""
    buckets, size = [[]], 0
    for name, tensor in named_tensors(weights):
        kind = dtype if tensor.is_floating_point() else tensor.dtype
        nbytes = tensor.numel() * kind.itemsize
        if buckets[-1] and (size + nbytes > bucket_mb * 2**20
                            or buckets[-1][-1].dtype != str(kind).removeprefix("torch.")):
            buckets.append([])
            size = 0
        buckets[-1].append(WeightSpec(name, tuple(tensor.shape), str(kind).removeprefix("torch.")))
        size += nbytes
    return [b for b in buckets if b]


class WeightGroup:
    """Trainer rank 0 (rank 0 here) and the engines (ranks 1..M) in a process group of their own,
    on its own TCPStore: torch.distributed's default group -- the trainers' data-parallel group,
    or the one vLLM sets up inside an engine process -- is never touched. gloo through host memory
    on CPU (and between processes sharing one GPU), NCCL between GPUs."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str):
        timeout = timedelta(minutes=10)
        self.store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        self.device = "cuda" if backend == "nccl" else "cpu"
        self.group = (dist.ProcessGroupNCCL(self.store, rank, world_size) if backend == "nccl"
                      else dist.ProcessGroupGloo(self.store, rank, world_size, timeout))

    def send(self, weights, layout: list[list[WeightSpec]]):
        """Rank 0: each bucket flattened into one buffer (the only copy made) and broadcast.
        weights: a state dict or full_weights' pairs, in the layout's order."""
        pairs = iter(named_tensors(weights))
        for bucket in layout:
            dtype, parts = getattr(torch, bucket[0].dtype), []
            for spec in bucket:
                name, tensor = next(pairs)
                if name != spec.name:
                    raise RuntimeError(f"weight sync: {name} came where the layout has {spec.name}")
                parts.append(tensor.detach().to(self.device, dtype).reshape(-1))
            flat = torch.cat(parts)
            del parts
            self.group.broadcast(flat.view(torch.uint8), 0).wait()

    def receive(self, layout: list[list[WeightSpec]]):
        """Engines: (name, tensor) pairs, one bucket received at a time as the loader asks."""
        for bucket in layout:
            sizes = [math.prod(s.shape) for s in bucket]
            flat = torch.empty(sum(sizes), dtype=getattr(torch, bucket[0].dtype),
                               device=self.device)
            self.group.broadcast(flat.view(torch.uint8), 0).wait()
            for spec, part in zip(bucket, flat.split(sizes)):
                yield spec.name, part.view(spec.shape)


class WeightSync:
    """vLLM worker extension (passed as `worker_extension_cls`): methods here run inside the worker
    that owns the model, called through the public `LLM.collective_rpc`."""

    def load_trainer_weights(self, named_tensors):
        # The worker's reload_weights (this class is mixed into vLLM's worker): it sets vLLM's
        # current config around the model runner's, whose loaders may read it (quantized layers
        # do; without it they raise). That runs the model's own checkpoint loader (name mapping,
        # QKV fusing, tied embeddings) and then the backend's weight post-processing -- what a
        # plain model.load_weights() skips, which breaks the CPU backend.
        self.reload_weights(weights_iterator=iter(named_tensors))

    def join_weight_group(self, host: str, port: int, rank: int, world_size: int, backend: str):
        self.weight_group = WeightGroup(host, port, rank, world_size, backend)

    def receive_trainer_weights(self, layout: list[list[WeightSpec]]):
        # The loader pulls bucket after bucket from the broadcast as it loads them.
        self.reload_weights(weights_iterator=self.weight_group.receive(layout))

    def runner_name(self) -> str:
        """Which model runner this vLLM chose: on a GPU 0.32 uses V2 (vllm.v1.worker.gpu.*)
        whenever Triton is importable; VLLM_USE_V2_MODEL_RUNNER=0 falls back to V1."""
        return f"{type(self.model_runner).__module__}.{type(self.model_runner).__name__}"


# ---------------------------------------------------------------------------------------------
# The trainers' side: every rank calls these (a sharded model gathers); rank 0 sends.


def weights_of(trainer, dtype=None):
    """The full weights on trainer rank 0, as model.full_weights' (name, tensor) pairs -- taken
    one at a time, each cast to `dtype` where it is, before any copy to the host --, None on the
    others. Every rank calls it: a sharded (FSDP) model gathers them."""
    weights = full_weights(trainer.model, dtype)
    if trainer.group is not None and dist.get_rank() != 0:
        return None
    return weights


def layout_of(trainer) -> list | None:
    """The buckets of a weight sync (weight_layout), on rank 0. Every rank calls it."""
    weights = weights_of(trainer)
    return None if weights is None else weight_layout(weights, DTYPES[trainer.cfg.dtype])


def join_weight_group(trainer, host, port, world_size, backend, layout):
    """Rank 0 leads the weight-sync group (WeightGroup); the other ranks are not in it."""
    if trainer.group is None or dist.get_rank(trainer.group) == 0:
        trainer.weight_group = WeightGroup(host, port, 0, world_size, backend)
        trainer.weight_layout = layout


def send_weights(trainer):
    """Rank 0 broadcasts its weights to the engines, bucket by bucket. Every rank calls it: a
    sharded (FSDP) model gathers them."""
    weights = weights_of(trainer)  # taken one by one as the buckets fill
    if weights is not None:
        trainer.weight_group.send(weights, trainer.weight_layout)


# ---------------------------------------------------------------------------------------------
# On Ray: sync(step) -> seconds, after which every engine holds the weights of `step`.


def weight_sync_by_collective(trainers, engines, nccl: bool) -> Callable[[int], float]:
    """Join trainer rank 0 and every engine in a weight-sync group (WeightGroup); returns
    sync(step) -> seconds, after which every engine holds the weights of `step`. nccl: GPU to GPU
    (NCCL cannot join two processes on one GPU: colocated engines take them by gloo)."""
    from distributed import gather
    ranks = [()] * len(trainers.workers)
    layout = trainers.run(layout_of, ranks)[0]
    (host, port), world = trainers.address(), 1 + len(engines.workers)
    backend = "nccl" if nccl else "gloo"
    gather(trainers.submit(join_weight_group, [(host, port, world, backend, layout)] * len(ranks))
           + engines.submit(_engine_joins, [(host, port, 1 + i, world, backend)
                                            for i in range(len(engines.workers))]))

    def sync(step: int) -> float:
        t0 = time.perf_counter()
        # Engines still generating (--async-steps) would keep rank 0 waiting inside the broadcast
        # for as long, against the group's timeout: start it once every engine is free.
        gather(engines.submit(_engine_free, [()] * len(engines.workers)))
        gather(trainers.submit(send_weights, ranks)
               + engines.submit(_engine_receives, [(layout, step)] * len(engines.workers)))
        return time.perf_counter() - t0
    return sync


def weight_sync_by_object_store(trainers, engines, dtype) -> Callable[[int], float]:
    """sync(step): rank 0 puts its weights (cast to the engines' dtype on its device) in Ray's
    object store, and every engine pulls a copy."""
    return lambda step: engines.update_weights(trainers.weights_ref(
        functools.partial(weights_of, dtype=dtype)), step)


def weight_sync_in_place(engines) -> Callable[[int], float]:
    """sync(step) for engines that decode from their trainers' own tensors (engine_beside): the
    weights are new already; the engines take the step's number."""
    def sync(step: int) -> float:
        t0 = time.perf_counter()
        engines.run(_engine_takes_version, step)
        return time.perf_counter() - t0
    return sync


def _engine_takes_version(engine, version):
    engine.update_weights({}, version)  # (shares_weights: nothing is copied)


def _engine_free(engine):
    """Returns once the engine has finished the calls queued before this one."""


def _engine_joins(engine, host, port, rank, world_size, backend):
    engine.join_weight_group(host, port, rank, world_size, backend)


def _engine_receives(engine, layout, version):
    return engine.receive_weights(layout, version)
