"""grpo.py on Ray with --async-steps 1, end to end, in both dtypes."""

import pytest

pytest.importorskip("ray")

from conftest import read_metrics, run_grpo, simulated_nodes  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    """The address of a one-node Ray with 2 CPUs, as grpo.py's own local Ray has on a 2-core
    machine, that the file's Ray runs join: started once, not once a run (~6 s each to start and
    stop; grpo.py starting its own local Ray is tested by test_faults.py's Ray run)."""
    with simulated_nodes(0, head_cpus=2) as (cluster, _):
        yield cluster.address


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_grpo_on_ray_with_async_steps_samples_what_a_synchronous_run_does(dtype, tiny_model_dir,
                                                                           tmp_path, local_ray):
    """grpo.py on Ray (2 trainers + 1 engine, colocated, collective weight sync) with
    --async-steps 1: the engine samples step t+1 while the trainers train step t. With lr 0 the lag
    cannot change what is sampled, so in fp32 everything but the numerics of pi_old (the engine's
    log-probs instead of the trainer's) must equal a one-process synchronous run's: the same
    problems, seeds, completions and rewards. In bf16 the engine on Ray drew other tokens than the
    one in this process (an AMX Xeon: rewards 0.5 vs 0.625 at step 1): it was built without the
    prompt-sharing verdict, so it decoded every prompt whole where this process's engine shares
    their prefix -- other numerics, and a token at a sampling boundary flips with the last bit of
    a bf16 logit. Fixed in issue 40 and pinned without Ray, bit for bit (test_rollout.py's
    test_a_ray_engine_is_built_from_what_the_trainers_start_from...); on the Zen 5 EPYC this
    bf16 run now draws the one-process run's tokens, rewards and held-out score exactly, but the
    AMX Xeon was not measured again, and a Ray worker computes on fewer threads (OMP_NUM_THREADS),
    so bf16 equality is not asserted here. What must hold in both dtypes is the lag and that the
    trainer's log-probs describe what the engine sampled: the async ratio pi_theta / pi_engine is
    1 within the dtype's rounding. (In a file of its own: its runs join one local Ray, which
    another file's run must not find, and the suite's files run in parallel, one per core.)"""
    args = ["--model", tiny_model_dir, "--data", "arith", "--steps", "2", "--prompts-per-step",
            "2", "--num-generations", "4", "--max-new-tokens", "6", "--eval-every", "2",
            "--eval-size", "4", "--temperature", "1.0", "--lr", "0", "--beta", "0.01",
            "--reward", "tests.rewards:parity_reward", "--dtype", dtype]
    on_ray = ["--num-trainers", "2", "--num-engines", "1", "--colocate", "--ray-address", local_ray]
    run_grpo([*args, *on_ray, "--async-steps", "1", "--out", str(tmp_path / "a")])
    lagged = read_metrics(tmp_path / "a")
    assert [r["step"] for r in lagged] == [0, 1, 2] and "eval_accuracy" in lagged[-1]
    assert (tmp_path / "a" / "model" / "model.safetensors").exists()  # saved by trainer rank 0
    assert [r["policy_lag"] for r in lagged[1:]] == [0, 1]
    for a in lagged[1:]:  # pi_theta / pi_engine with equal weights
        assert a["ratio"] == pytest.approx(1.0, abs=0.02)
    if dtype == "bf16":  # (no comparison to make: no one-process run)
        return
    run_grpo([*args, "--out", str(tmp_path / "s")])
    synced = read_metrics(tmp_path / "s")
    assert [r["policy_lag"] for r in synced[1:]] == [0, 0]
    for a, s in zip(lagged[1:], synced[1:]):
        for key in ("reward", "completion_len", "zero_std_frac", "truncated_frac", "trained_frac"):
            assert a[key] == s[key], key
        assert a["loss"] == pytest.approx(s["loss"], abs=0.02)
    assert lagged[-1]["eval_accuracy"] == synced[-1]["eval_accuracy"]
    # (Synchronous on Ray, colocated, equal to one process: test_nodes.py's run across nodes,
    # the same command with lr 1e-3, its losses to rel 1e-5 and gradient norms to rel 1e-4.)


def _words(text: str) -> str:
    return " ".join(text.split())


def test_where_async_steps_cannot_overlap_the_run_says_what_the_docs_say(tiny_model_dir,
                                                                            tmp_path, capsys):
    """--async-steps 1 overlaps generation and training only where engines and trainers can work
    at once: on Ray, with engines on devices of their own, or colocated on CPUs. In one process
    the engine generates, then the trainer trains; colocated on GPUs the update waits for the
    engines to finish and sleep (test_distributed.py's
    test_a_colocated_engine_sleeps_only_once_its_generation_is_done). The run says so at start,
    in the words of docs/distributed.md -- which once said a colocated vLLM engine "generates
    while the trainers train"."""
    from pathlib import Path

    import grpo
    from cli import parse_config
    from trainer import ASYNC_TURNS, async_turns, setup_local
    docs = _words((Path(__file__).resolve().parents[1] / "docs" / "distributed.md").read_text())
    assert "generates (its KV cache awake) while the trainers train" not in docs
    for line in ASYNC_TURNS.values():
        assert _words(line) in docs
    lagged = parse_config(grpo.Config, ["--model", tiny_model_dir, "--async-steps", "1",
                                        "--out", str(tmp_path / "out")])
    synced = parse_config(grpo.Config, ["--model", tiny_model_dir, "--out", str(tmp_path / "o")])
    colocated = parse_config(grpo.Config, ["--model", tiny_model_dir, "--async-steps", "1",
                                           "--num-trainers", "2", "--colocate",
                                           "--out", str(tmp_path / "c")])
    assert async_turns(lagged, on_ray=False, gpus=False) == ASYNC_TURNS["one process"]
    assert async_turns(colocated, on_ray=True, gpus=True) == ASYNC_TURNS["colocated on GPUs"]
    assert async_turns(colocated, on_ray=True, gpus=False) is None  # (the cores are shared)
    apart = parse_config(grpo.Config, ["--model", tiny_model_dir, "--async-steps", "1",
                                       "--num-trainers", "2", "--out", str(tmp_path / "a")])
    assert async_turns(apart, on_ray=True, gpus=True) is None
    assert async_turns(synced, on_ray=False, gpus=True) is None
    capsys.readouterr()
    setup_local(lagged, train_step=None)
    assert ASYNC_TURNS["one process"] in capsys.readouterr().out
