"""distributed.Cluster on a Ray cluster that has GPUs while the driver has none: a local Ray told it
has 2 GPUs and 8 CPUs (Ray takes declared GPUs on a machine without any, and sets each worker's
CUDA_VISIBLE_DEVICES to the ones it holds). In a file of its own: Ray starts once a process."""

import os
import sys
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from distributed import Cluster, Worker, cpus_per_gpu  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def gpu_cluster():
    """Ray with 2 pretend GPUs and 8 CPUs on one node (more than this machine's cores: Ray counts
    what it is told)."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=8, num_gpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    yield
    ray.shutdown()


def _nothing():
    return None


def _seen(state):
    """(Run on a worker.) Its torch threads and the GPUs Ray made visible to it."""
    return torch.get_num_threads(), os.environ.get("CUDA_VISIBLE_DEVICES")


def _started(worker):
    ray.get(worker.setup.remote(_nothing))
    return worker


def test_gpu_bundles_follow_the_clusters_gpus_and_each_worker_takes_its_share_of_cpus(gpu_cluster,
                                                                                    capsys):
    """The driver sees no GPU (this machine has none), the cluster has 2: GPU bundles, each with
    its node's 4 CPUs per GPU; colocated, a trainer and its engine each hold half a GPU and 2 CPUs
    and compute on 2 threads -- not on the CPU (bundles decided by the driver's own
    torch.cuda.is_available), nor on every core of the node (each worker of a GPU node sees one
    device), nor on one thread (what Ray's OMP_NUM_THREADS says for num_cpus 0)."""
    assert not torch.cuda.is_available()
    cluster = Cluster(num_trainers=2, num_engines=1, colocate=True)
    try:
        assert cluster.use_gpu
        # (what the driver chose from its own hardware, it says: --dtype auto, the memory plan)
        assert "note: the driver sees no GPU, the Ray cluster has 2" in capsys.readouterr().out
        assert cluster.pg.bundle_specs == [{"GPU": 1, "CPU": 4}] * 2
        workers = [_started(Worker.options(**cluster._options(i)).remote()) for i in (0, 1, 0)]
        seen = ray.get([w.run.remote(_seen) for w in workers])  # trainer 0, 1, engine 0
        assert [threads for threads, _ in seen] == [2, 2, 2]
        gpus = [visible for _, visible in seen]
        assert gpus[0] == gpus[2] != gpus[1] and set(gpus) == {"0", "1"}  # engine 0 on trainer 0's
        for w in workers:
            ray.kill(w)
    finally:
        ray.util.remove_placement_group(cluster.pg)
    alone = Cluster(num_trainers=1, num_engines=1)  # engines on GPUs of their own: a whole bundle
    try:
        worker = _started(Worker.options(**alone._options(1)).remote())
        assert ray.get(worker.run.remote(_seen))[0] == 4
    finally:
        ray.util.remove_placement_group(alone.pg)


def test_a_gpu_bundle_holds_the_fewest_cpus_per_gpu_of_any_gpu_node():
    """A CPU-only head node (where the driver runs) counts for nothing; every GPU node must fit a
    bundle for each of its GPUs."""
    head = {"Alive": True, "Resources": {"CPU": 64.0}}
    big = {"Alive": True, "Resources": {"CPU": 96.0, "GPU": 8.0}}
    small = {"Alive": True, "Resources": {"CPU": 32.0, "GPU": 4.0}}
    gone = {"Alive": False, "Resources": {"CPU": 2.0, "GPU": 4.0}}
    assert cpus_per_gpu([head, big, small, gone]) == 8
    assert cpus_per_gpu([head, big]) == 12
    # A GPU node with fewer CPUs than GPUs (a head node started with --num-cpus 0, say): bundles
    # of a GPU alone, which it fits -- with a CPU each, 4 of its 8 GPUs could be reserved, and the
    # run waited for the rest and stopped ("busy cluster?"). Its workers compute on one thread.
    few = {"Alive": True, "Resources": {"CPU": 4.0, "GPU": 8.0}}
    for nodes in ([few], [big, few], [{"Alive": True, "Resources": {"GPU": 8.0}}]):
        share = cpus_per_gpu(nodes)
        assert all(share * n["Resources"]["GPU"] <= n["Resources"].get("CPU", 0) for n in nodes)
    assert cpus_per_gpu([few]) == 0
