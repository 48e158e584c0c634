"""Ray placement groups, torch.distributed (gloo) trainers and sharded engines, on CPU."""

import os
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from distributed import Cluster, shard  # noqa: E402
import conftest  # noqa: E402
from conftest import rl_trainer, make_batch, record_grads, simulated_nodes  # noqa: E402
from grpo import Config, train_on_rollout  # noqa: E402
from logprobs import completion_logprobs, pack  # noqa: E402
from trainer import engine_beside, finish_metrics, setup_trainer  # noqa: E402
from rollout import HFRollout, decoding_mode  # noqa: E402
from sampling import Sampling, policy_lag  # noqa: E402
from weight_sync import weight_sync_by_collective, weight_sync_in_place, weights_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Helpers defined here run on Ray workers, which cannot import this test module: ship them by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(conftest)


def test_shard_is_contiguous_and_complete():
    assert [list(r) for r in shard(5, 2)] == [[0, 1], [2, 3, 4]]
    assert [list(r) for r in shard(1, 2)] == [[], [0]]


@pytest.fixture(scope="module")
def cluster():
    """Two nodes simulated on this machine, 1 CPU each: trainer i and engine i share node i's
    bundle, so every test below has its trainers' process group, and trainer 0's weight group
    with the engines, span two raylets, as on two machines."""
    with simulated_nodes(2) as (nodes, _):
        c = Cluster(num_trainers=2, num_engines=2, colocate=True, address=nodes.address)
        yield c
        c.shutdown()


# Every worker process imports torch and transformers as it starts (~5-10 s on two cores): the
# file starts its trainers and its engines once, and each test builds what it needs in them again
# with Worker.setup -- the method cluster.trainers and cluster.engines call once a process is up,
# a trainer's given the process group it joined. What a test built before is dropped.
def _nothing(group=None):
    return None


def _again(workers, setup, *args):
    ray.get([w.setup.remote(setup, *args) for w in workers.workers])
    return workers


@pytest.fixture(scope="module")
def started():
    return {}


def _alive(pool) -> bool:
    """Whether every worker answers (a test may have killed one, or failed with one waiting in
    a collective that never completes)."""
    try:
        ray.get([w.address.remote() for w in pool.workers], timeout=60)
        return True
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        for w in pool.workers:
            ray.kill(w)
        return False


@pytest.fixture
def trainer_pool(cluster, started):
    """The file's two trainer processes, in their process group; started again if they fail."""
    if "trainers" not in started or not _alive(started["trainers"]):
        started["trainers"] = cluster.trainers(_nothing)
    return started["trainers"]


@pytest.fixture
def engine_pool(cluster, started):
    """The file's two engine processes; started again if they fail."""
    if "engines" not in started or not _alive(started["engines"]):
        started["engines"] = cluster.engines(_nothing)
    return started["engines"]


def test_the_workers_land_on_both_nodes_and_the_run_says_where(cluster, trainer_pool,
                                                                engine_pool):
    """The table a run prints once its workers are up: one line a worker, with its node's Ray id,
    host and IP, and its pid. Trainer i and engine i share node i's bundle; PACK spreads the
    bundles over both nodes, which hold one each."""
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")}
    assert len(nodes) == 2
    table = cluster.placement()
    assert table.splitlines()[0] == "Ray placed the workers on 2 nodes:", table
    landed = {}
    for who, pool in (("trainer rank", trainer_pool), ("engine", engine_pool)):
        for i, pid in enumerate(ray.get([w.run.remote(_pid) for w in pool.workers])):
            line = next(row for row in table.splitlines() if row.strip().split("  ")[0] ==
                        f"{who} {i}")
            node = re.search(r"node ([0-9a-f]{56}) on \S+ \((\S+)\)", line)
            assert node and f"pid {pid}" in line, line
            assert node[2] == ray.util.get_node_ip_address(), line
            landed[f"{who} {i}"] = node[1]
    assert landed["trainer rank 0"] == landed["engine 0"] != landed["trainer rank 1"]
    assert landed["trainer rank 1"] == landed["engine 1"] and set(landed.values()) == nodes


def _pid(state):
    import os
    return os.getpid()


def _cfg(model_dir):
    # fp32 so that one and two trainers can be compared tightly; beta > 0 trains every sequence.
    return Config(data="arith", model=model_dir, dtype="fp32", beta=0.02, lr=1e-3, micro_batch_size=2,
                  max_new_tokens=6)


def _batch(in_loss=None):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16], [17, 18, 19]]
    completions = [[20, 21, 2], [22, 2], [23, 24, 25, 26], [27, 2], [28], [29, 30, 2]]
    return make_batch(prompts, completions, [1.0, -1.0, 0.5, -0.5, 2.0, 0.0], in_loss=in_loss)


def _one_vs_two_trainers(trainer_pool, cfg, in_loss=None):
    batch = _batch(in_loss)
    single = rl_trainer(cfg)
    single_grads = record_grads(single)
    one = finish_metrics([train_on_rollout(single, batch)])

    trainers = _again(trainer_pool, setup_trainer, cfg, "", cfg.reference())
    args = [(batch.select(slice(r.start, r.stop)),) for r in shard(len(batch.advantages), 2)]
    raws, groups, grads = zip(*trainers.run(_train_counting_collectives, args))
    grads = grads[0]
    two = finish_metrics(list(raws))
    # every all-reduce (DDP's gradients, the trained-count check) ran on the trainers' own group
    assert all(g == "trainers" for g in groups[0] + groups[1]) and len(groups[0]) > 0
    weights = ray.get(trainers.weights_ref(weights_of))

    # The same global loss and the same (all-reduced) gradient: fp32; measured differences are
    # ~5e-6 of each tensor's largest element (summation order), the tolerance is 1e-4 of it.
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
    for name, g in single_grads.items():
        assert torch.allclose(grads[name], g, rtol=1e-3, atol=1e-4 * float(g.abs().max())), name
    # The same weights after one AdamW step. Adam's first step is lr * g / (|g| + eps): where a
    # gradient element is ~eps, summation-order noise is amplified, so a few elements may differ
    # by a fraction of lr; all others agree to 1e-6.
    for name, p in single.model.state_dict().items():
        diff = (weights[name] - p).abs()
        assert diff.max() < 0.2 * cfg.lr, name
        assert int((diff > 1e-6).sum()) <= max(2, 1e-3 * diff.numel()), name
    moved = (weights["model.layers.0.mlp.up_proj.weight"] - rl_trainer(cfg).model.state_dict()[
        "model.layers.0.mlp.up_proj.weight"]).abs().max()
    assert moved > 1e-4  # the step really changed the weights
    return trainers


def _train_counting_collectives(trainer, batch):
    """train_on_rollout, recording which group each dist.all_reduce call was given, and the
    gradients it stepped with."""
    import torch.distributed as dist
    real, groups = dist.all_reduce, []

    def counting(tensor, *args, group=None, **kwargs):
        groups.append("trainers" if group is trainer.group else repr(group))
        return real(tensor, *args, group=group, **kwargs)

    grads = record_grads(trainer)
    dist.all_reduce = counting
    try:
        return train_on_rollout(trainer, batch), groups, grads
    finally:
        dist.all_reduce = real


def test_one_trainer_equals_two_trainers_each_holding_half_of_adams_moments(
        trainer_pool, tiny_model_dir, tmp_path):
    """Two data-parallel trainers step as one process does (above), with AdamW's moments split
    between them (ZeRO-1); a checkpoint holds them whole, as one process would have written them,
    and either kind of run resumes from it."""
    cfg = _cfg(tiny_model_dir)
    trainers = _one_vs_two_trainers(trainer_pool, cfg)
    trainable = sum(p.numel() for p in rl_trainer(cfg).model.parameters() if p.requires_grad)
    held = trainers.run(_moments_held, [()] * 2)
    # each rank a share of whole tensors, balanced as the tensors allow (the tiny model's
    # embedding is 96 % of it; SmolLM2-135M's largest tensor is 21 %)
    assert sum(held) == trainable and min(held) > 0, (held, trainable)

    from trainer import save_trainer
    trainers.run(save_trainer, [(str(tmp_path),)] * 2)
    whole = trainers.run(_optimizer_state, [()] * 2)[0]
    saved = torch.load(tmp_path / "trainer_state.pt", weights_only=True)["optimizer"]
    single = rl_trainer(cfg, str(tmp_path))  # one process resumes from two trainers' checkpoint
    resumed = _again(trainers, setup_trainer, cfg, str(tmp_path), cfg.reference())
    again = resumed.run(_optimizer_state, [()] * 2)[0]
    assert resumed.run(_moments_held, [()] * 2) == held
    # one copy of a rank's moments (ZeRO's loader left a second in its wrapper), each step
    # tensor beside its weight (a GPU's fused AdamW refuses one on the CPU)
    assert resumed.run(_after_loading, [()] * 2) == [(0, True), (0, True)]
    names = {i: n for i, n in enumerate(n for n, p in single.model.named_parameters()
                                        if p.requires_grad)}
    assert len(saved["state"]) == len(names) == len(whole["state"])
    for state in (single.optimizer.state_dict(), again):
        for i in names:
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state["state"][i][key], whole["state"][i][key]), (names[i], key)
                assert torch.equal(saved["state"][i][key], whole["state"][i][key]), (names[i], key)


def _after_loading(trainer) -> tuple[int, bool]:
    """(entries in the ZeRO wrapper's own state, every step tensor on its weight's device)."""
    local = trainer.optimizer.optim.state
    return len(trainer.optimizer.state), all(s["step"].device == p.device
                                             for p, s in local.items())


def _moments_held(trainer) -> int:
    """How many elements of AdamW's first moment this rank's optimizer holds."""
    local = getattr(trainer.optimizer, "optim", trainer.optimizer)  # (ZeRO wraps a local AdamW)
    return sum(s["exp_avg"].numel() for s in local.state.values())


def test_fsdp_two_trainers_equal_one_process(trainer_pool, tiny_model_dir, tmp_path):
    """FSDP2 on gloo: the ranks run the same number of passes (here 2 and 1 real micro-batches,
    and beta = 0 with zero advantages, which the plain path would skip), and saving gathers the
    full weights."""
    cfg = replace(_cfg(tiny_model_dir), fsdp=True, num_trainers=2, beta=0.0, micro_batch_size=1)
    # rank 0's shard is sequences 0-2, of which two are out of the loss: 1 pass against rank 1's 3
    trainers = _one_vs_two_trainers(trainer_pool, cfg, in_loss=torch.tensor([0, 0, 1, 1, 1, 1]).bool())
    assert trainers.run(_is_sharded, [()] * 2) == [True, True]
    from trainer import save_trainer
    trainers.run(save_trainer, [(str(tmp_path),)] * 2)
    from safetensors.torch import load_file
    saved = load_file(tmp_path / "model.safetensors")
    weights = ray.get(trainers.weights_ref(weights_of))
    assert set(saved) <= set(weights) and all(torch.equal(saved[k], weights[k]) for k in saved)
    # --resume scatters the saved optimizer state over the ranks again
    before = trainers.run(_optimizer_state, [()] * 2)[0]["state"]
    resumed = _again(trainers, setup_trainer, cfg, str(tmp_path), cfg.reference())
    after = resumed.run(_optimizer_state, [()] * 2)[0]["state"]
    assert before.keys() == after.keys() and len(before) > 0
    for name in before:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(before[name][key], after[name][key]), (name, key)


def _optimizer_state(trainer):
    from model import full_optimizer_state
    return full_optimizer_state(trainer.model, trainer.optimizer)


def _is_sharded(trainer):
    from model import is_sharded
    return is_sharded(trainer.model)


def _engine_setup(model_dir):
    from model import load_model
    model, tokenizer = load_model(model_dir)
    return HFRollout(model, tokenizer, dtype=torch.float32)


def _weight_sum(engine):
    return float(sum(p.double().sum() for p in engine.model.parameters()))


def test_one_engine_vs_two_engines_and_weight_sync(engine_pool, tiny_model_dir, tiny_model):
    model, tokenizer = tiny_model
    engines = _again(engine_pool, _engine_setup, tiny_model_dir)
    local = HFRollout(model, tokenizer, dtype=torch.float32)
    prompts = [tokenizer(f"What is {i} + {i}?")["input_ids"] for i in range(5)]
    greedy = Sampling(max_new_tokens=6, temperature=0.0)
    # Greedy: one engine and two engines give the same completions, in the same order. (Sampled
    # completions differ: each engine draws from its own RNG stream over its own shard.)
    two = engines.generate(prompts, 2, greedy)
    one = local.generate(prompts, 2, greedy)
    assert two.completion_ids == one.completion_ids and two.prompt_ids == one.prompt_ids
    # Sampled, the engines seed their shards apart: given the same seed, the two engines would
    # draw the same samples for the same prompt in the same place of their shards.
    sampled = engines.generate([prompts[0]] * 4, 1, Sampling(6, temperature=1.0, seed=7))
    assert sampled.completion_ids[:2] != sampled.completion_ids[2:]

    trained = rl_trainer(_cfg(tiny_model_dir)).model
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01)
    seconds = engines.update_weights({k: v for k, v in trained.state_dict().items()})
    assert seconds > 0
    expected = float(sum(p.double().sum() for p in trained.parameters()))
    for got in engines.run(_weight_sum):
        assert got == pytest.approx(expected, rel=1e-6)


def test_unsatisfiable_placement_fails_fast_with_a_clear_message(cluster):
    with pytest.raises(SystemExit, match="needs 6 CPU bundles; the Ray cluster has 2 CPUs"):
        Cluster(num_trainers=3, num_engines=3)


def test_a_workers_oserror_outside_a_checkpoint_is_a_failed_worker_not_a_traceback(monkeypatch):
    """Only a full disk (or a file-size limit) is the driver's to name as such (a checkpoint's
    write, session.write_checkpoint): any other OSError a worker raises -- the model's folder
    missing on its node, which transformers raises as OSError -- ends the run as a failed
    worker does, its traceback (which worker, which file) kept, not as a bare OSError raised in
    the driver."""
    import errno
    import distributed
    cause = OSError(f"Incorrect path_or_model_id: '/data/model'. Please provide the path of a "
                    f"local folder")
    failed = ray.exceptions.RayTaskError("Worker.setup", "Traceback (most recent call last):\n"
                                         "  File \"model.py\", line 1, in load_model\n"
                                         f"OSError: {cause}", cause)

    def get(refs, **_):
        raise failed
    monkeypatch.setattr(distributed.ray, "get", get)
    monkeypatch.setattr(distributed, "_died_among", lambda refs: None)
    monkeypatch.setattr(distributed.ray, "nodes", lambda: [])
    with pytest.raises(SystemExit, match=r"a trainer worker failed:\n(.|\n)*path_or_model_id"):
        distributed._get([], "trainer")
    for code in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):  # (a disk full: the driver names it)
        failed = ray.exceptions.RayTaskError("Worker.run", "", OSError(code, os.strerror(code)))
        with pytest.raises(OSError) as raised:
            distributed._get([], "trainer")
        assert raised.value.errno == code


def _perturb(trainer, seed):
    """The same noise on every rank (replicas stay equal), large enough to see in log-probs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def _sent_logprobs(trainer, ids, pl, cl):
    """Log-probs under rank 0's weights as a sync sends them (in the run's compute dtype, so
    rounded to bf16 in a bf16 run), computed in fp32 like the test engines."""
    import copy
    from hardware import DTYPES
    model = copy.deepcopy(trainer.model)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(DTYPES[trainer.cfg.dtype]).float())
        return completion_logprobs(model, ids, pl, cl)[0]


def _engine_logprobs(engine, ids, pl, cl):
    with torch.no_grad():
        return completion_logprobs(engine.model, ids, pl, cl)[0]


def _version(engine):
    return engine.version


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_colocated_hf_engines_live_in_their_trainers_and_decode_from_their_tensors(
        cluster, trainer_pool, tiny_model_dir, dtype):
    """--colocate with the HF engine (trainer.setup_ray): engine i is built in trainer i's process
    on its very tensors, as in a one-process run -- no copy of the weights, nothing to send, and
    an update is what the next generation samples from. In bf16 those tensors are the trainer's
    bf16 copy, which the optimizer step refreshes from the fp32 master weights."""
    cfg = replace(_cfg(tiny_model_dir), num_trainers=2, num_engines=2, colocate=True, dtype=dtype)
    assert cfg.engine_shares_weights()
    for apart in (dict(colocate=False), dict(num_engines=3), dict(async_steps=1),
                  dict(fsdp=True), dict(rollout="vllm"), dict(lora_rank=4)):
        assert not replace(cfg, **apart).engine_shares_weights(), apart
    trainers = _again(trainer_pool, setup_trainer, cfg, "", cfg.reference())
    engines = cluster.engines_in(trainers, engine_beside, cfg)
    sync = weight_sync_in_place(engines)
    where = trainers.run(_trainer_tensors_at, [()] * 2)
    assert engines.run(_engine_tensors_at) == where and where[0][0] != where[1][0]
    ids, pl, cl = pack([[5, 6, 7], [8]], [[9, 10, 2], [11, 12, 13, 2]], pad_id=2)
    before = engines.run(_engine_logprobs, ids, pl, cl)
    trainers.run(train_on_rollout, [(_batch().select(slice(0, 3)),),
                                    (_batch().select(slice(3, 6)),)])
    after = engines.run(_engine_logprobs, ids, pl, cl)
    expected = trainers.run(_trainer_logprobs, [(ids, pl, cl)] * 2)
    for b, a, e in zip(before, after, expected):
        assert torch.equal(a, e) and (a - b).abs().max() > 1e-4
    assert sync(1) < 1.0 and engines.run(_version) == [1, 1]
    comps = engines.generate([[5, 6, 7]] * 2, 2, Sampling(4, temperature=1.0, seed=0))
    assert comps.policy_version == 1 and len(comps.completion_ids) == 4
    # what the run records, for its resumption to decode alike (the suite pins flash: fp32 is
    # never flash, its cache grows)
    assert decoding_mode(engines) == {"fp32": "grow", "bf16": "flash"}[dtype]


def _trainer_tensors_at(trainer):
    import os
    return os.getpid(), trainer.compute.get_input_embeddings().weight.data_ptr()


def _engine_tensors_at(engine):
    import os
    return os.getpid(), engine.model.get_input_embeddings().weight.data_ptr()


def _trainer_logprobs(trainer, ids, pl, cl):
    with torch.no_grad():
        return completion_logprobs(trainer.compute, ids, pl, cl)[0]


def test_collective_weight_sync_reaches_every_engine_and_a_skipped_one_is_caught(
        trainer_pool, engine_pool, tiny_model_dir, tmp_path):
    """Trainer rank 0 (of 2) broadcasts to 2 engines in a gloo group of their own; and the check
    that every trainer sees --out."""
    cfg = _cfg(tiny_model_dir)
    trainers = _again(trainer_pool, setup_trainer, cfg, "", cfg.reference())
    engines = _again(engine_pool, _engine_setup, tiny_model_dir)
    sync = weight_sync_by_collective(trainers, engines, nccl=False)
    ids, pl, cl = pack([[5, 6, 7], [8]], [[9, 10, 2], [11, 12, 13, 2]], pad_id=2)
    trainers.run(_perturb, [(0,)] * 2)  # "step 1"
    expected = trainers.run(_sent_logprobs, [(ids, pl, cl)] * 2)[0]
    for stale in engines.run(_engine_logprobs, ids, pl, cl):  # the check below can fail
        assert (stale - expected).abs().max() > 1e-2
    assert sync(1) > 0
    for got in engines.run(_engine_logprobs, ids, pl, cl):
        assert torch.allclose(got, expected, atol=1e-6)
    assert engines.run(_version) == [1, 1]
    # The trainers' own group still works after the weight group joined them (a training step).
    one = finish_metrics(trainers.run(train_on_rollout, [(_batch().select(slice(0, 3)),),
                                                         (_batch().select(slice(3, 6)),)]))
    assert one["grad_norm"] > 0
    # Step 2's sync is skipped: step 3's batch says it was sampled with step 1's weights.
    comps = engines.generate([[5, 6, 7]] * 2, 2, Sampling(4, temperature=1.0, seed=0))
    assert comps.policy_version == 1
    with pytest.raises(SystemExit, match="a weight sync was skipped"):
        policy_lag(comps, step=3, allowed=0)
    assert policy_lag(comps, step=3, allowed=1) == 1  # with --async-steps 1
    # On several nodes --out must be shared: a trainer that cannot see it stops the run at start.
    trainers.check_shared_folder(str(tmp_path))  # one machine: every rank sees the driver's file
    with pytest.raises(SystemExit, match=r"--out .* is not visible from trainer rank 1 on node "
                                         r"10.0.0.2: on several nodes --out must be a shared"):
        trainers.check_shared_folder(str(tmp_path), sees=_only_rank0_sees)
    assert list(tmp_path.iterdir()) == []  # the probe file is gone either way


def _only_rank0_sees(trainer, path):
    import torch.distributed as dist
    return "10.0.0.2", dist.get_rank(trainer.group) == 0 and Path(path).exists()


def test_ppo_one_trainer_equals_two_trainers(trainer_pool, tiny_model_dir):
    """ppo.py on 2 gloo ranks, each holding its shard of the policy and of the critic: the same
    policy and value losses, explained variance and gradient norms as one process (advantages
    whitened and the explained variance taken over the global batch: their sums all-reduced)."""
    from dataclasses import replace as with_
    import ppo
    from trainer import setup_for
    cfg = ppo.Config(data="arith", model=tiny_model_dir, dtype="fp32", lr=1e-3, critic_lr=1e-3,
                     micro_batch_size=2, max_new_tokens=6, kl_coef=0.02)
    batch = with_(_batch(), rewards=torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 0.0]))
    one = finish_metrics([ppo.train_on_rollout(cfg.setup(), batch)])
    trainers = _again(trainer_pool, setup_for, cfg, "")
    args = [(batch.select(slice(r.start, r.stop)),) for r in shard(len(batch.advantages), 2)]
    two = finish_metrics(trainers.run(ppo.train_on_rollout, args))
    for key in ("loss", "value_loss", "explained_variance", "grad_norm", "value_grad_norm",
                "value_mean", "return_mean"):
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key


class _SlowEngine:
    """An engine whose generation takes a second, and which notes when it is asked to sleep."""

    def generate(self, prompt_ids, n, sampling):
        import time
        from sampling import Completions
        time.sleep(1.0)
        self.generated = time.time()
        return Completions([], [], [], [])

    def sleep(self):
        import time
        self.slept = time.time()


def _slow_engine():
    return _SlowEngine()


def _times(engine):
    return engine.generated, engine.slept


def test_a_colocated_engine_sleeps_only_once_its_generation_is_done(engine_pool):
    """Why --async-steps 1 --colocate on GPUs takes turns (trainer.ASYNC_TURNS): before the
    update, the driver asks the engines to sleep (their GPU memory is the update's), and an engine
    works through its calls in order -- the sleep waits for the generation of the next batch that
    the driver started first, and the update for the sleep."""
    from trainer import _engine_sleeps
    engines = _again(engine_pool, _slow_engine)
    pending = engines.submit_generate([[5, 6]] * 2, 1, Sampling(4))
    engines.run(_engine_sleeps)  # what setup_ray's train does first on colocated GPUs
    for generated, slept in engines.run(_times):
        assert slept >= generated
    pending.result()


def _engine_of_length(length: int):
    from types import SimpleNamespace
    return SimpleNamespace(max_model_len=length)


def _engine_deciding(mode: str):
    from types import SimpleNamespace
    from attention import DecodeChoice
    return SimpleNamespace(decoding=DecodeChoice(mode == "flash", mode != "concat", mode, mode))


def test_the_engines_of_a_run_decode_as_the_first_chose(engine_pool, capsys):
    """Each engine times its decoding when it starts, and on unlike nodes (or beside a busy core)
    two can choose apart, which changes a bf16 run's samples: setup_ray has every engine decode as
    the first chose -- the choice the run records, and a resumed run keeps."""
    from distributed import _decoding
    for worker, mode in zip(engine_pool.workers, ("concat", "flash")):
        ray.get(worker.setup.remote(_engine_deciding, mode))
    assert [choice.mode for choice in engine_pool.run(_decoding)] == ["concat", "flash"]
    engine_pool.decode_alike()
    assert [choice.mode for choice in engine_pool.run(_decoding)] == ["concat", "concat"]
    assert "their decoding timed apart (concat, flash); all decode as the first chose, concat" in \
        capsys.readouterr().out
    assert decoding_mode(engine_pool) == "concat"


def test_the_engines_on_ray_say_how_long_a_sequence_they_hold(engine_pool):
    """An episode's turns stay within the engine's max_model_len (env.Agent.budget) on Ray too:
    the engines behind an EngineGroup tell it (0: no limit, the HF engine)."""
    assert _again(engine_pool, _engine_of_length, 300).max_model_len == 300
    assert _again(engine_pool, _nothing).max_model_len == 0
    assert decoding_mode(_again(engine_pool, _nothing)) == ""  # (an engine that records none)


def test_a_driver_with_a_gpu_says_the_cluster_has_none(cluster, monkeypatch, capsys):
    """The cluster's resources decide GPU or CPU bundles: a driver on a GPU machine joined to a
    cluster without GPUs (its GPU nodes not yet up, say) gets CPU workers -- and what it chose
    from its own hardware (--dtype auto's bf16, --rollout auto's vLLM, a GPU's memory plan) was
    chosen for a GPU. It says so, as a driver without a GPU on a GPU cluster does; it said
    nothing, and the run trained on the CPUs."""
    import distributed
    monkeypatch.setattr(distributed, "_has_gpu", lambda: True)
    with pytest.raises(SystemExit, match="needs 6 CPU bundles"):
        Cluster(num_trainers=3, num_engines=3)
    assert "note: the driver has a GPU, the Ray cluster none" in capsys.readouterr().out


# Last of the file's tests: it kills an engine worker, and a test after it that wanted the
# engines would wait for two to start again (engine_pool: ~5 s each, importing torch).
def test_a_dead_worker_ends_the_run_with_a_message(engine_pool, tiny_model_dir, tokenizer):
    engines = _again(engine_pool, _engine_setup, tiny_model_dir)
    ray.kill(engines.workers[1])
    with pytest.raises(SystemExit, match="an engine worker died") as died:
        engines.generate([tokenizer("Hi")["input_ids"]] * 2, 1, Sampling(4, temperature=0.0))
    # one line: which worker, where, what Ray says of it, what to change
    line = str(died.value)
    assert "\n" not in line and re.search(r"\(engine 1, pid \d+, node [0-9a-f]{56} on \S+ "
                                          r"\(\S+\)\): .*ray.kill.*; the usual cause is memory",
                                          line), line
