"""Shared fixtures: a tiny random Llama model with the real SmolLM2 tokenizer (pad == eos); helpers
that build training batches and run grpo.py as a user would."""

import contextlib
import importlib.util
import io
import json
import os
import runpy
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Metrics that differ between identical runs (peak_flops: the machine's matmul rate, measured;
# the roofline fractions: floors over seconds)
TIMING = ("seconds", "tokens_per_s", "memory", "peak_flops", "mfu", "roofline_frac",
          "compute_frac", "memory_frac")


# What `--dtype auto` means in the tests: fp32 on every CPU kind, so that a test comparing two runs
# or an exact value does not depend on the machine (auto picks bf16 on AMX, fp32 on AVX2). The
# dtype-sensitive paths are tested in both dtypes explicitly. `pytest --auto-dtype bf16` runs the
# rest in bf16 too, as auto does on an AMX machine (slow where bf16 is emulated).
def pytest_addoption(parser):
    parser.addoption("--auto-dtype", choices=("fp32", "bf16"), default=None,
                     help="what --dtype auto resolves to in the tests (default: fp32, or "
                          "$SMOLRL_AUTO_DTYPE)")


AUTO_DTYPE_ENV = "SMOLRL_AUTO_DTYPE"  # hardware.py's (not imported: see `tokenizer` below)
# How the HF engine decodes, likewise the same on every machine: flash in bf16, the matmuls on a
# growing cache in fp32. Each engine would otherwise time the choice when it starts, and two
# engines compared in a bf16 test could choose apart. tests/test_rollout.py tests the timing.
DECODE_ENV, DECODE_PIN = "SMOLRL_DECODE", "flash"


def pytest_configure(config):
    os.environ[AUTO_DTYPE_ENV] = (config.getoption("--auto-dtype") or
                                  os.environ.get(AUTO_DTYPE_ENV) or "fp32")
    os.environ.setdefault(DECODE_ENV, DECODE_PIN)
    # `make test` runs a worker per core (pytest-xdist): each worker, and the runs it starts, get
    # the cores' share of threads. torch's default -- every core in every process -- has the
    # workers' OpenMP threads wait on each other's cores (2-core AVX2 EPYC: 775 s before, 714 s
    # after with four more tests).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def pytest_report_header(config):
    return (f"--dtype auto in these tests: {os.environ[AUTO_DTYPE_ENV]} (pytest --auto-dtype); "
            f"{DECODE_ENV}={os.environ[DECODE_ENV]}")


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer
    # Imported here, not at the top: a course grader must still collect the other exercises'
    # tests when a student's model.py does not import.
    from model import GGUF_FILE, GGUF_PACKAGE
    gguf_dir = importlib.util.find_spec(GGUF_PACKAGE).submodule_search_locations[0]
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_FILE)
    assert tok.pad_token_id == tok.eos_token_id  # the case masks must survive
    return tok


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A 2-layer Llama built from a config (random weights), saved in HF format. head_dim 64:
    vLLM's CPU attention kernels support only the usual head sizes."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tokenizer, seed=0)


def save_tiny_llama(path, tokenizer, seed: int) -> str:
    """The tiny Llama of tiny_model_dir, its random weights drawn with `seed`, saved in `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=512, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from model import load_model
    return load_model(tiny_model_dir)


def make_batch(prompts, completions, advantages, *, loss_agg="token-mean", max_new_tokens=8,
               in_loss=None, engine_logprobs=None):
    """An rl.TrainBatch from token lists, as main builds it from a rollout."""
    from rl import TrainBatch, loss_denominator
    from logprobs import pack
    ids, prompt_lens, completion_lens = pack(prompts, completions, pad_id=2)
    in_loss = torch.ones(len(prompts), dtype=torch.bool) if in_loss is None else in_loss
    denom = loss_denominator(loss_agg, completion_lens * in_loss, max_new_tokens)
    return TrainBatch(ids, prompt_lens, completion_lens, torch.as_tensor(advantages), in_loss,
                      engine_logprobs, denom)


def record_grads(trainer) -> dict:
    """The gradients the optimizer steps with (after clipping; gathered if sharded), filled in by
    each step: train_on_rollout frees them right after."""
    grads = {}

    def hook(optimizer, args, kwargs):
        for name, p in trainer.model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = g.detach().clone()

    trainer.optimizer.register_step_pre_hook(hook)
    return grads


RAY_FLAGS = ("--num-trainers", "--num-engines", "--ray-address")


def run_grpo(args):
    """python grpo.py ARGS as a user runs it; fails the test if it fails. The run goes through
    grpo.main in this process: a fresh interpreter would spend ~6 s of each run importing torch
    and transformers again (most of the suite's time). A run on Ray starts its local Ray here and
    leaves it running (the process would exit there): it is shut down after the run, so that the
    next run finds the CPUs free. Returns .stdout, what the run printed."""
    import grpo
    from cli import parse_config
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            grpo.main(parse_config(grpo.Config, list(args)))
    except SystemExit as e:  # a run that stops with one line: the test fails with that line
        pytest.fail(f"grpo.py {' '.join(args)} stopped: {e}\n{printed.getvalue()[-3000:]}")
    finally:
        if any(flag in args for flag in RAY_FLAGS):
            import ray
            ray.shutdown()
    return SimpleNamespace(stdout=printed.getvalue(), returncode=0)


# The simulated clusters' health checks (Ray 2.60's defaults: every 3,000 ms, 5 missed in a row)
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 5}


@contextlib.contextmanager
def simulated_nodes(count: int, head_cpus: int = 0):
    """A Ray cluster of `count` nodes simulated on this machine (ray.cluster_utils: each node a
    raylet of its own, with 1 CPU) beside a head node with `head_cpus` CPUs: none by default,
    the node where a driver connects, as on a real cluster (Ray refuses to remove the driver's
    own node); simulated_nodes(0, head_cpus=2) is a one-node local Ray that several runs join
    instead of each starting and stopping its own (~6 s a run). Yields (cluster, its nodes); a
    run joins it with --ray-address cluster.address. Its files are in a temporary folder of its
    own (RAY_TMPDIR): Ray writes a cluster's address to <temp>/ray/ray_current_cluster, where a
    local run's ray.init() in another test file (pytest-xdist) would find it and join this
    cluster instead of starting its own Ray."""
    import ray
    from ray.cluster_utils import Cluster
    before = os.environ.get("RAY_TMPDIR")
    # (short: a raylet's socket paths must fit 107 bytes)
    os.environ["RAY_TMPDIR"] = folder = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    # A node is declared dead after HEALTH_CHECKS[failure_threshold] missed health checks:
    # checked every second rather than Ray's 3 s, a lost node is known ~5 s after it goes,
    # not ~15 s (test_nodes.py waits for that). Each check still has Ray's 10 s to be answered,
    # so a live node on a busy machine is no sooner taken for dead.
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": head_cpus, "include_dashboard": False,
                                      "_system_config": HEALTH_CHECKS})
    try:
        nodes = [cluster.add_node(num_cpus=1) for _ in range(count)]
        cluster.wait_for_nodes()
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()
        if before is None:
            del os.environ["RAY_TMPDIR"]
        else:
            os.environ["RAY_TMPDIR"] = before
        shutil.rmtree(folder, ignore_errors=True)


class RanTooLong(BaseException):
    """Raised in a script run_script runs past its deadline: a BaseException, so that no
    `except Exception` in the product takes it for a failed step and goes on."""


def run_script(script, args, deadline=600):
    """python SCRIPT ARGS, run in this process as __main__ (runpy): its exit code, stdout and
    stderr, a SystemExit's message or an uncaught exception's traceback written there as the
    interpreter writes them. For a check that must stop a run with one line before any model
    loads, without a fresh interpreter importing torch and transformers again. (What only a fresh
    process shows -- a warning printed at import, say -- needs a subprocess: an exact stderr.)
    A run still going after `deadline` seconds fails the test (RanTooLong), as a subprocess's
    timeout would, instead of holding up its worker. Where the caller has an alarm of its own
    running (a nested run_script, a test's own limit), that alarm is the run's deadline, left as
    it is; a script that takes SIGALRM for itself fails the test, its deadline gone."""
    # signals reach the main thread only; a caller's timer already running bounds the run
    timed = running = (threading.current_thread() is threading.main_thread()
                       and signal.getitimer(signal.ITIMER_REAL)[0] == 0)

    def too_long(*_):
        if running:  # (an alarm due once the run is over does nothing)
            raise RanTooLong(f"{script} {' '.join(map(str, args))}: still running after "
                             f"{deadline} s")
    if timed:
        before = signal.signal(signal.SIGALRM, too_long)
        signal.alarm(deadline)
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        argv, sys.argv = sys.argv, [script, *args]
        try:
            runpy.run_path(str(ROOT / script), run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        except Exception:
            traceback.print_exc()
            code = 1
        finally:
            running = False  # (first)
            sys.argv = argv
            if timed:
                signal.alarm(0)
                taken = signal.signal(signal.SIGALRM, before)
    if timed and taken is not too_long:
        raise AssertionError(f"{script} set its own SIGALRM handler: run_script's deadline was off")
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def small_run_args(model_dir, out):
    """A few-second run of the tiny model; parity_reward gives groups signal, so steps update."""
    return ["--model", model_dir, "--data", "arith", "--prompts-per-step", "2",
            "--num-generations", "4", "--max-new-tokens", "6", "--eval-every", "0", "--beta", "0.01",
            "--temperature", "1.0", "--lr", "1e-3", "--reward", "tests.rewards:parity_reward",
            "--out", str(out)]


def read_metrics(out):
    """metrics.jsonl without the timing figures."""
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rows]


# Relative tolerances by compute dtype, for quantities summed over many terms (gradients, losses):
# their rounding depends on the summation order, which differs between CPUs (AVX2 vs AVX-512 kernels)
# and between batchings -- fp32 measured up to 2.5e-6 of the largest gradient entry on an AVX2 CPU.
REL_TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def assert_close_to_scale(actual, expected, dtype=torch.float32, what="tensors"):
    """|actual - expected| <= REL_TOL[dtype] x max|expected|, elementwise: the error a sum's
    rounding makes scales with its largest terms, so a bare absolute tolerance is too tight for
    large values and meaningless for tiny ones."""
    actual, expected = torch.as_tensor(actual).float(), torch.as_tensor(expected).float()
    scale = float(expected.abs().max())
    diff = float((actual - expected).abs().max())
    assert diff <= REL_TOL[dtype] * scale, (f"{what}: largest difference {diff:.3g} exceeds "
                                            f"{REL_TOL[dtype]} x the largest value {scale:.3g}")


def check_an_episode_on(engine, model, tokenizer, monkeypatch, atol: float):
    """Play one episode on a real engine (HF or vLLM): its first turn stops at once (the greedy
    token is made a stop token) and calls the calculator (the parse is stood in for: a tiny random
    model writes no tool calls); its second turn must continue from the prompt, the sampled ids and
    the tool result's ids, appended. The engine's log-probs match the trainer's on the model's
    tokens and are 0 on the environment's; the mask is True on exactly the sampled tokens."""
    from env import Agent, ToolChat, load_tools
    from logprobs import completion_logprobs, pack
    from sampling import Sampling
    chat = ToolChat(tokenizer, load_tools("calculator"))
    call = {"type": "function", "function": {"name": "calculator",
                                             "arguments": {"expression": "2 + 3"}}}
    parses = iter([{"content": "", "tool_calls": [call]}])
    monkeypatch.setattr(chat, "parse", lambda prefix, turn: next(parses, {"content": "5"}))
    agent = Agent(chat, "{problem}", 3, 256)
    prompt = agent.start([{"problem": "What is 2 + 3?"}], 1)[0].prompt_ids
    with torch.no_grad():
        first = int(model(torch.tensor([prompt])).logits[0, -1].argmax())
    monkeypatch.setattr(engine, "stop_ids", {tokenizer.eos_token_id, first})
    inputs, generate = [], engine.generate
    monkeypatch.setattr(engine, "generate", lambda prompts, n, sampling: (
        inputs.append(prompts), generate(prompts, n, sampling))[1])
    comps, (episode,) = agent.run(engine, [{"problem": "What is 2 + 3?"}], 1, Sampling(6, 0.0))
    observation = chat.observation_ids([("calculator", "5")])
    assert inputs[1] == [prompt + [first] + observation]
    assert episode.ids[:1 + len(observation)] == [first] + observation
    assert episode.mask == [True] + [False] * len(observation) + \
        [True] * (len(episode.ids) - 1 - len(observation))
    if comps.engine_logprobs is not None:  # (the HF engine gives them when asked)
        ids, prompt_lens, lens = pack([prompt], [episode.ids], pad_id=0)
        with torch.no_grad():
            trainer, _ = completion_logprobs(model, ids, prompt_lens, lens)
        mask, engine_lps = torch.tensor(episode.mask), torch.tensor(comps.engine_logprobs[0])
        assert (trainer[0][mask] - engine_lps[mask]).abs().max() < atol
        assert torch.all(engine_lps[~mask] == 0)
    return episode


def peak_rss_growth(fn) -> tuple[int, object]:
    """(bytes by which this process's peak resident memory rose while fn() ran, fn's result):
    the kernel's high-water mark (VmHWM), reset first through /proc/self/clear_refs. Memory a
    step holds and frees again counts; what torch's CPU allocator takes comes from the kernel
    (large blocks are mmap'ed and returned at once), so the figure is the step's real peak."""
    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
    import gc
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # (resets VmHWM to the current RSS)
    before = status("VmRSS:")
    result = fn()
    return status("VmHWM:") - before, result


class FreshTensors(TorchDispatchMode):
    """Counts the tensors of `numel` elements the ops make while active -- fresh storage, not a
    view of an op's input: each is a pass over that many elements and, on a CPU, its page
    faults. How the tests of SmallAttention's and the norm's passes count them."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() == self.numel and \
                    t.untyped_storage().data_ptr() not in inputs:
                self.count += 1
        return out


def rl_trainer(cfg, resume_dir: str = ""):
    """trainer.setup_trainer as the RL loop calls it: with a KL reference when the Config keeps
    one (grpo.Config: --beta > 0)."""
    from trainer import setup_trainer
    return setup_trainer(cfg, resume_dir, reference=cfg.reference())
