"""grpo.py on several nodes simulated on this machine (ray.cluster_utils: each node a raylet of its
own, 1 CPU), and a node lost mid-run. In a file of its own: its cluster is the runs' only Ray."""

import contextlib
import io
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ray = pytest.importorskip("ray")

import distributed  # noqa: E402
from checkpoint import find_checkpoint  # noqa: E402
from conftest import assert_close_to_scale, read_metrics, run_grpo, simulated_nodes  # noqa: E402
from conftest import small_run_args  # noqa: E402

# fp32: one process and two trainers compare tightly; a checkpoint every step
STEPS = ["--steps", "2", "--save-every", "1", "--dtype", "fp32"]
# engine 0 in trainer 0's process: each run takes two of the nodes, one bundle a node
ON_RAY = ["--num-trainers", "2", "--num-engines", "1", "--colocate"]


@pytest.fixture(scope="module")
def nodes():
    """Three nodes of 1 CPU: a run takes two, and goes on with two when one is lost."""
    with simulated_nodes(3) as (cluster, nodes):
        yield cluster, nodes


@pytest.fixture(scope="module")
def across_nodes(nodes, tiny_model_dir, tmp_path_factory):
    """An uninterrupted run on two of the nodes: its --out and what it printed."""
    out = tmp_path_factory.mktemp("across-nodes")
    printed = run_grpo([*small_run_args(tiny_model_dir, out), *STEPS, *ON_RAY,
                        "--ray-address", nodes[0].address]).stdout
    return out, printed


def test_a_run_across_nodes_trains_as_one_process_does_and_says_where_each_worker_landed(
        nodes, across_nodes, tiny_model_dir, tmp_path):
    """Two trainers on two nodes (their gloo group and its all-reduce between raylets, the
    engine beside trainer 0): the samples, rewards and losses of one process. And the run says
    at start where Ray placed each worker: its node's id, host and IP."""
    out, printed = across_nodes
    run_grpo([*small_run_args(tiny_model_dir, tmp_path), *STEPS])
    across, alone = read_metrics(out), read_metrics(tmp_path)
    assert [r["step"] for r in across] == [r["step"] for r in alone] == [1, 2]
    assert [r["policy_lag"] for r in across] == [0, 0]  # (synchronous: no step sampled stale)
    for a, o in zip(across, alone):
        for key in ("reward", "completion_len", "zero_std_frac", "truncated_frac",
                    "trained_frac"):
            assert a[key] == o[key], key
        assert a["loss"] == pytest.approx(o["loss"], rel=1e-5, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(o["grad_norm"], rel=1e-4)
    ids = {node.node_id for node in nodes[1]}
    assert "Ray placed the workers on 2 nodes:" in printed
    rows = {who: re.search(rf"^  {who} +node ([0-9a-f]{{56}}) on \S+ \((\S+)\)  pid \d+$",
                           printed, re.M) for who in ("trainer rank 0 \\+ engine 0",
                                                      "trainer rank 1")}
    assert all(rows.values()), printed
    assert {row[1] for row in rows.values()} < ids and len({row[1] for row in rows.values()}) == 2


def test_a_node_lost_mid_run_stops_it_in_one_line_and_the_nodes_left_finish_it_exactly(
        nodes, across_nodes, tiny_model_dir, tmp_path, capfd, monkeypatch):
    """The node of trainer rank 1 dies as in a crash (its raylet and workers killed) once step 1
    is checkpointed: the run stops within two minutes, in one line naming the worker and its
    node; step 1's checkpoint is whole, and `--resume auto` on the two nodes left -- the same
    command, as many trainers -- ends with the uninterrupted run's weights, bit for bit; in one
    process, to within rounding. (Ray declares the node dead once it misses 5 health checks,
    1 s apart on these simulated nodes -- conftest.HEALTH_CHECKS; Ray's default is 3 s: the run
    stops ~5 s after the node, ~15 s on a cluster of Ray's defaults.)"""
    cluster, workers_nodes = nodes
    args = [*small_run_args(tiny_model_dir, tmp_path), *STEPS, *ON_RAY,
            "--ray-address", cluster.address]
    lost = {}

    import grpo
    import session
    from cli import parse_config
    save_checkpoint = session.save_checkpoint

    def then_lose_trainer_1s_node(out, *rest):
        # In the driver, as step 1's checkpoint is written: a watcher thread polling for it lost
        # the race on a loaded machine (step 2 and the model written 1 s later, the run over)
        save_checkpoint(out, *rest)
        if (out / "checkpoints" / "step_1").exists() and not lost:
            place = next(p for p in distributed.PLACED.values() if p.who == "trainer rank 1")
            lost.update(node=place.node, at=time.monotonic())
            cluster.remove_node(next(n for n in workers_nodes if n.node_id == place.node),
                                allow_graceful=False)
            gone_by = time.monotonic() + 60  # (its worker outlives its raylet by ~1 s)
            while alive(place.pid):
                # (not fails_after's TimeoutError: an OSError, which the checkpoint's save would
                # report as its own)
                assert time.monotonic() < gone_by, f"trainer rank 1's worker {place.pid} lives on"
                time.sleep(0.05)

    monkeypatch.setattr(session, "save_checkpoint", then_lose_trainer_1s_node)
    with pytest.raises(SystemExit) as stopped, contextlib.redirect_stdout(io.StringIO()), \
            fails_after(300):
        grpo.main(parse_config(grpo.Config, args))
    seconds = time.monotonic() - lost["at"]
    ray.shutdown()
    line, printed = str(stopped.value.code), capfd.readouterr()
    print(f"stopped {seconds:.1f} s after the node was lost: {line}")  # (pytest -rP shows it)
    assert seconds < 120
    assert "\n" not in line and line.startswith("error: trainer rank 1 was lost with its node "
                                                f"{lost['node']}"), line
    assert "--resume auto" in line and "Traceback" not in printed.out + printed.err
    assert find_checkpoint(tmp_path, "auto") == str(tmp_path / "checkpoints" / "step_1")

    alone = tmp_path.parent / f"{tmp_path.name}-alone"  # (a copy, for a second way on)
    shutil.copytree(tmp_path, alone)
    monkeypatch.undo()
    run_grpo([*args, "--resume", "auto"])
    whole = load_file(across_nodes[0] / "model" / "model.safetensors")
    resumed = load_file(tmp_path / "model" / "model.safetensors")
    assert resumed.keys() == whole.keys()
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)
    assert read_metrics(tmp_path) == read_metrics(across_nodes[0])
    # Or in one process, without Ray: one trainer where there were two, the same weights to
    # within the rounding of a sum taken in another order
    run_grpo([*small_run_args(tiny_model_dir, alone), *STEPS, "--resume", "auto"])
    one = load_file(alone / "model" / "model.safetensors")
    for k in whole:  # (measured: 3e-7 of the largest element, at most)
        assert_close_to_scale(one[k], whole[k], what=k)
    shutil.rmtree(alone)  # (outside tmp_path: pytest would keep it)


def alive(pid: int) -> bool:
    """Whether a process runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # (gone, or reaped as it was read)
        return False


@contextlib.contextmanager
def fails_after(seconds: int):
    """A run that hangs fails the test (SIGALRM) instead of holding up the suite."""
    def hung(signum, frame):
        raise TimeoutError(f"the run did not stop within {seconds} s")

    before = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
