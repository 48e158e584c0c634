"""The RL loop's pieces, shared by every algorithm that samples from its policy (grpo.py,
distill.py, ppo.py): a run's set-up, a step's rollout and scores, the batch the trainers take, a
step's end and the finish. Each algorithm's file keeps what makes it itself -- its options, its
advantages or targets, its loss, its train_on_rollout -- and a short main over these:

    session = start_session(cfg, train_on_rollout)         # data, tools, models, step 0's eval
    for step in ...:
        started = start_rollout(run, problems, cfg, seed)  # G completions of N prompts
        scored = score(started, cfg, reward_fns, grader)   # ... and their rewards
        update = run.train(train_batch(scored.completions, advantages, cfg, pad_id))
        run.sync_weights(step)
        end_step(session, cfg, step, record, scored)       # eval, log, samples, checkpoint
    finish_session(session, cfg, title)

Samples are prompt-major (sample k of prompt i at i * G + k) throughout.
"""

import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch

from data import TEMPLATES, ProblemStream, encode_prompts, load_problems, task_summary
from env import Agent, Episode, load_environment, load_tools
from evaluate import evaluate_held_out, show_samples, step_record
from hardware import DTYPES
from logprobs import length_mask, pack, right_pad
from model import DEFAULT_MODEL, model_path
from reward import Grader, RewardFunctions, correctness_reward, overlong_penalty
from reward_models import check_learned_rewards, learned_rewards
from rollout import decoding_mode
from rollout_log import RolloutLog, check_log, detail_index, detail_samples
from rollout_log import saved_steps
from sampling import Completions, Ready, Sampling
from session import RunFolder, after_step, close_run, open_run, resume_driver, start_log
from trainer import count_bad_steps, setup_local, setup_ray


# ---------------------------------------------------------------------------------------------
# A run's set-up and its end.

@dataclass
class Session:
    """What a run's loop works with."""
    folder: RunFolder  # --out: checkpoints, metrics, the driver's state (session.py)
    run: object  # trainer.Run: the engines, the trainers, weight sync, saving
    problems: ProblemStream  # the training problems, from where the run stands
    eval_rows: list[dict]
    reward_fns: RewardFunctions
    grader: Grader
    rollouts: RolloutLog  # <out>/rollouts.jsonl: every step's samples, scores, advantages
    replay: dict | None = None  # --replay: a saved run's samples of each step, trained on again

    @property
    def driver(self):
        return self.folder.driver


def start_session(cfg, train_step, line=None) -> Session:
    """Everything before a run's first step, checked in the order that fails fastest: the task
    line, the checkpoints (a resumed run's, and never another run's), --replay's log, the
    model's folder or hub id, the data, the tools, then the models (train_step: what a trainer
    runs on a rollout batch; the trainers keep a KL reference when cfg.reference() says so); the
    config is written to <out>/<cfg.CONFIG_FILE>, and a fresh run is evaluated at step 0."""
    print(task_summary(cfg))
    if cfg.memory_plan:
        print(cfg.memory_plan)
    folder = open_run(cfg)
    if folder.samples and folder.samples.exists():  # (kept up to the checkpoint)
        check_log(folder.samples, "; mend that line, or move the file away to resume without "
                                  "its samples")
    replay = replay_steps(cfg)
    if cfg.model != DEFAULT_MODEL or getattr(cfg, "init_from", ""):  # (the offline default
        # cannot be mistyped, and resolving it converts its GGUF file on a fresh machine)
        model_path(cfg)  # a folder or a loadable hub id: a mistyped --model makes MATH from
        # the hub the default task (data.task_of) -- named here, not the dataset it implied
    train_rows, eval_rows, columns = load_problems(cfg)  # data first: fail before the model loads
    tools, env_class = load_tools(cfg.tools), load_environment(cfg.env)  # checked here, too
    # episodes (--tools, --env): the model acts, tools and the environment answer
    agent = Agent.for_run(cfg, TEMPLATES[cfg.template][0], tools, env_class)
    if cfg.memory_plan or cfg.rollout == "vllm":  # (a file's rows; a generated task's prompts
        # are short and alike)
        check_prompt_room(cfg, {"training": getattr(train_rows, "rows", []),
                                "held-out": eval_rows}, agent)
    check_learned_rewards(cfg.reward_model, cfg.judge, cfg.judge_prompt)
    grader = Grader()  # math-verify workers start (untimed) when an answer first needs them
    learned = learned_rewards(cfg.reward_model, cfg.judge, cfg.judge_prompt, cfg.template,
                              DTYPES[cfg.dtype])  # (reward models and judges, frozen)
    reward_fns = RewardFunctions(cfg.reward, TEMPLATES[cfg.template][1], grader,
                                 cfg.require_think_close, columns, env_class, learned)
    resume_driver(folder)
    run = (setup_ray if cfg.on_ray() else setup_local)(cfg, train_step, folder.resume_dir,
                                                       folder.driver.step)
    run.agent = agent
    problems = ProblemStream(train_rows, skip=folder.driver.consumed)
    start_log(folder, cfg, line, decoding_mode(run.rollout))
    session = Session(folder, run, problems, eval_rows, reward_fns, grader,
                      RolloutLog(folder.out, folder.driver.step, folder.samples), replay)
    if cfg.eval_every and eval_rows and folder.driver.step == 0:
        folder.log({"step": 0, **evaluate(session, cfg, 0)})
    return session


def check_prompt_room(cfg, problems: dict[str, list[dict]], agent=None):
    """On a GPU the memory plan made room for prompts of --max-prompt-tokens (the KV cache of a
    step's batch, the longest sequence a micro-batch holds), and a vLLM engine holds prompts of
    that many tokens (rollout.engine_length): a longer prompt stops the run here, in one line,
    before any model loads (the tokenizer alone measures them). An episode's (agent) is measured
    as its first turn gets it, the tools' descriptions shown (an environment's reset text, which
    only its code can tell, left out)."""
    from model import load_tokenizer
    tokenizer = load_tokenizer(model_path(cfg))
    for which, rows in problems.items():
        lengths = [len(agent.chat.prompt_ids(agent.messages(row))) for row in rows] if agent \
            else [len(ids) for ids in encode_prompts(tokenizer, rows, cfg.template, cfg.chat)]
        longest = max(lengths, default=0)
        if longest > cfg.max_prompt_tokens:
            made = "the GPU memory plan made" if cfg.memory_plan else "the vLLM engine makes"
            raise SystemExit(f"error: {cfg.data}: {which} problem {lengths.index(longest) + 1} is "
                             f"a prompt of {longest:,} tokens (chat template"
                             f"{' and tools' if agent else ''} included), longer "
                             f"than the {cfg.max_prompt_tokens:,} {made} room for; pass "
                             f"--max-prompt-tokens {longest}"
                             f"{' (--dry-run shows the plan)' if cfg.memory_plan else ''} or "
                             f"shorter prompts")


def replay_steps(cfg) -> dict | None:
    """--replay: the saved samples of every step the run will take, checked now (rollout_log),
    their token ids against the vocabulary in the model's config (no weights loaded)."""
    if not cfg.replay:
        return None
    if Path(cfg.replay).resolve() == Path(cfg.out).resolve():
        raise SystemExit(f"error: --replay {cfg.replay} is this run's own --out, whose "
                         f"rollouts.jsonl the run starts anew; pass another --out")
    try:
        from transformers import AutoConfig
        vocab = AutoConfig.from_pretrained(model_path(cfg), trust_remote_code=False) \
            .get_text_config().vocab_size
    except (Exception, SystemExit):  # no config to read: the model's own load says why, later
        vocab = None
    return saved_steps(cfg.replay, cfg.num_generations, cfg.steps, vocab)


def evaluate(session: Session, cfg, step: int) -> dict:
    """The held-out evaluation's metrics; its samples go to the rollout log. Episodes (an agent)
    are played no more at a time than a training step plays: the engine keeps each one's keys
    and values between turns, and 128 held-out multiply episodes at once, beside the trainer's
    optimizer state, were the run's peak (docs/benchmarks.md, Memory)."""
    batch = {"batch_prompts": cfg.prompts_per_step * cfg.num_generations} if session.run.agent \
        else {}
    metrics, samples = evaluate_held_out(session.run, session.eval_rows, cfg, session.grader,
                                         **batch)
    session.rollouts.eval(step, samples, session.eval_rows)
    return metrics


def end_step(session: Session, cfg, step: int, record: dict, scored: "Scored", pending: int = 0,
             save: bool = True):
    """A step's end: the held-out evaluation when due, the metrics logged, a few samples shown,
    and the checkpoint when due (save: the step's update was good) or when a signal asked the
    run to stop, which it then does (session.after_step). pending: problems drawn for a batch
    that was started but not trained on yet."""
    run, driver = session.run, session.driver
    if session.eval_rows and cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
        record.update(evaluate(session, cfg, step))
    record["rollout_log_seconds"], session.rollouts.seconds = session.rollouts.seconds, 0.0
    session.folder.log(record)
    if cfg.log_samples_every and step % cfg.log_samples_every == 0:
        show_samples(scored.rows, [run.tokenizer.decode(c) for c in  # (episodes: all turns)
                                   scored.completions.completion_ids] if scored.episodes
                     else scored.completions.text, scored.rewards)
    driver.step, driver.consumed = step, session.problems.taken - pending
    after_step(session.folder, cfg, run.save, good=save)  # (a signal: stops the run here)


def finish_session(session: Session, title: str, **plot):
    """After the last step: the model alone in <out>/model, and the curves (session.close_run)."""
    session.grader.close()
    close_run(session.folder, session.run.export, title, **plot)


def sampling_seed(cfg, step: int, attempt: int) -> int:
    """A seed per step and rollout round, so a resumed run samples what the original would."""
    return (cfg.seed * 1_000_003 + step) * 16 + attempt


# ---------------------------------------------------------------------------------------------
# Sampling and scoring: N prompts -> G completions each -> rewards.


@dataclass
class Scored:
    """One round of rollouts, prompt-major (sample k of prompt i at i * G + k), with its scores."""
    rows: list[dict]  # the problem of every sample (each repeated G times)
    completions: Completions
    rewards: torch.Tensor  # (N*G,) weighted sum of the reward functions (+ overlong penalty)
    correct: list[float]  # (N*G,) answer correctness whatever the reward is ([]: no answers)
    per_fn: dict[str, list[float]]  # each reward function's scores
    gen_seconds: float = 0.0
    reward_seconds: float = 0.0
    episodes: list = field(default_factory=list)  # --tools / --env: each sample's env.Episode

    def select(self, indices: list[int]) -> "Scored":
        return Scored([self.rows[i] for i in indices], self.completions.select(indices),
                      self.rewards[indices],
                      [self.correct[i] for i in indices] if self.correct else [],
                      {name: [s[i] for i in indices] for name, s in self.per_fn.items()},
                      episodes=[self.episodes[i] for i in indices] if self.episodes else [])

    @staticmethod
    def concat(parts: list["Scored"]) -> "Scored":
        return Scored([r for p in parts for r in p.rows],
                      Completions.concat([p.completions for p in parts]),
                      torch.cat([p.rewards for p in parts]), [c for p in parts for c in p.correct],
                      {name: [s for p in parts for s in p.per_fn[name]] for name in parts[0].per_fn},
                      sum(p.gen_seconds for p in parts), sum(p.reward_seconds for p in parts),
                      [e for p in parts for e in p.episodes])


@dataclass
class Started:
    """A round of rollouts on its way: the problems, and the engines' work (.result())."""
    rows: list[dict]
    pending: object  # .result() -> Completions
    episodes: list = field(default_factory=list)  # --tools / --env: played to the end already


def start_rollout(run, rows: list[dict], cfg, seed: int) -> Started:
    """Ask the engines (run: a trainer.Run) for G completions of each problem in `rows`. Engines on
    Ray work in the background; an engine in this process generates right away. Episodes
    (--tools, --env) are played here, turn by turn (env.Agent)."""
    sampling = Sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_p, seed)
    if run.agent:
        comps, episodes = run.agent.run(run.rollout, rows, cfg.num_generations, sampling)
        return Started(rows, Ready(comps), episodes)
    prompts = encode_prompts(run.tokenizer, rows, cfg.template, cfg.chat)
    return Started(rows, run.rollout.submit_generate(prompts, cfg.num_generations, sampling))


def score(started: Started, cfg, reward_fns: RewardFunctions, grader: Grader,
          overlong_buffer: int = 0) -> Scored:
    """The completions of a started round, and their rewards (less DAPO's soft overlong penalty
    over the last overlong_buffer tokens of the budget: see overlong)."""
    G, rows = cfg.num_generations, started.rows
    comps = started.pending.result()
    # The engines' own time: with --async-steps 1 a batch was started a training step ago.
    gen_seconds, t0 = comps.seconds, time.time()
    group_rows = [r for r in rows for _ in range(G)]
    # As TRL passes them: the prompt column as it is (chat messages, or the problem text); for
    # episodes, their messages and their environments.
    prompts = [r["prompt"] if isinstance(r.get("prompt"), list) else r["problem"]
               for r in group_rows]
    completions, extra = comps.text, {}
    if started.episodes:
        prompts, completions = [e.prompt for e in started.episodes], \
            [e.messages for e in started.episodes]
        if started.episodes[0].env is not None:
            extra["environments"] = [e.env for e in started.episodes]
    rewards, per_fn = reward_fns(prompts, completions, comps.completion_ids, group_rows, **extra)
    correct = per_fn.get("correctness") or ([] if "answer" not in rows[0] else correctness_reward(
        prompts, comps.text, [r["answer"] for r in group_rows],
        answer_format=TEMPLATES[cfg.template][1], grader=grader))
    if overlong_buffer:
        rewards = [r + p for r, p in zip(rewards, overlong(comps, cfg, bool(started.episodes),
                                                            overlong_buffer))]
    return Scored(group_rows, comps, torch.tensor(rewards), correct, per_fn, gen_seconds,
                  time.time() - t0, started.episodes)


def overlong(comps: Completions, cfg, episodes: bool, buffer: int) -> list[float]:
    """DAPO's soft overlong penalty of each sample, against the budget it was cut at: a
    completion's length against --max-new-tokens; an episode's whole length (every turn and tool
    result: what --max-episode-tokens caps) against --max-episode-tokens. A two-turn episode is
    not "long" for having more tokens than one turn may."""
    budget = cfg.max_episode_tokens if episodes else cfg.max_new_tokens
    return overlong_penalty([len(c) for c in comps.completion_ids], budget, buffer)


# ---------------------------------------------------------------------------------------------
# The batch the trainers take.


@dataclass
class TrainBatch:
    """One step's rollout as the trainers see it (under Ray, each gets a contiguous shard)."""
    input_ids: torch.Tensor  # (B, L) prompt + completion, right-padded
    prompt_lens: torch.Tensor  # (B,)
    completion_lens: torch.Tensor  # (B,) sampled tokens, the stop token included
    advantages: torch.Tensor  # (B,)
    in_loss: torch.Tensor  # (B,) bool; False: no loss weight (overlong filtering), still sampled
    engine_logprobs: torch.Tensor | None  # (B, T) the engine's log-prob of each sampled token
    denom: float  # grpo_loss's denominator for the *global* batch (see loss_denominator)
    token_mask: torch.Tensor | None = None  # (B, T) episodes: True for the model's own tokens,
    # False for the environment's (tool results), which are never trained; None: all of them
    rewards: torch.Tensor | None = None  # (B,) the samples' rewards, for an algorithm whose
    # trainers make the advantages (ppo.py: per-token rewards, a critic, GAE)
    train_policy: bool = True  # False: the critic alone steps (ppo.py's --critic-warmup)
    detail: torch.Tensor | None = None  # (B,) long: the sample's index where the trainer reports
    # its per-token numbers for the rollout log (rollout_log.detail_index), -1 elsewhere

    def loss_mask(self, idx, T: int) -> torch.Tensor:
        """(b, T) the tokens of rows `idx` that the loss covers: the completion's (from its
        length), less the environment's in an episode."""
        mask = length_mask(self.completion_lens[idx], T)
        return mask if self.token_mask is None else mask & self.token_mask[idx][:, :T]

    def select(self, idx) -> "TrainBatch":
        """Rows `idx` (a slice, or an index tensor)."""
        return self._map(lambda t: t[idx])

    def to(self, device) -> "TrainBatch":
        return self._map(lambda t: t.to(device))

    def _map(self, fn) -> "TrainBatch":
        return replace(self, **{f.name: fn(getattr(self, f.name)) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})


def loss_denominator(loss_agg: str, completion_lens: torch.Tensor, max_new_tokens: int) -> float:
    """The global-batch denominator grpo_loss needs for micro-batching to leave the loss unchanged."""
    sequences = float((completion_lens > 0).sum())  # overlong-filtered samples have length 0
    return {"token-mean": float(completion_lens.sum()),
            "seq-mean": sequences,
            "seq-sum-norm": sequences * max_new_tokens}[loss_agg]




def train_batch(comps: Completions, advantages, cfg, pad_id: int, loss_agg: str = "token-mean",
                overlong_filter: bool = False) -> TrainBatch:
    """Pack scored completions for the trainers. Masks come from lengths; with overlong filtering
    (DAPO) a truncated sample is out of the loss (it still counted in its group's baseline).
    loss_agg: what the loss's denominator counts (loss_denominator)."""
    input_ids, prompt_lens, completion_lens = pack(comps.prompt_ids, comps.completion_ids, pad_id)
    in_loss = torch.ones(len(comps), dtype=torch.bool)
    if overlong_filter:
        in_loss = ~torch.tensor(comps.truncated)
    engine_lps = None
    if comps.engine_logprobs is not None:
        engine_lps = right_pad(comps.engine_logprobs, 0.0, torch.float32)  # (B, T)
    token_mask, trained_lens = None, completion_lens  # (episodes: the model's tokens only)
    if comps.mask is not None:
        token_mask = right_pad(comps.mask, False, torch.bool)  # (B, T)
        trained_lens = token_mask.sum(1)
    denom = loss_denominator(loss_agg, trained_lens * in_loss, cfg.max_new_tokens)
    return TrainBatch(input_ids, prompt_lens, completion_lens, advantages, in_loss, engine_lps,
                      denom, token_mask)


# ---------------------------------------------------------------------------------------------
# The rollout log (rollout_log.py) and --replay.


def with_detail(batch: TrainBatch, rewards: torch.Tensor, cfg) -> TrainBatch:
    """The batch, its samples for per-token detail marked (--rollout-tokens): the trainers report
    what their update computed for those."""
    samples = detail_samples(rewards, batch.advantages, cfg.num_generations, cfg.rollout_tokens)
    return replace(batch, detail=detail_index(len(rewards), samples))


def log_rollouts(session: Session, cfg, step: int, sampled: Scored, batch: TrainBatch | None,
                 tokens: dict, kept: list[bool] | None = None, per_sample_advantages=True):
    """Every sample the step drew to <out>/rollouts.jsonl: kept, the ones the update took (None:
    all), in the order of `batch`, with its advantages (per_sample_advantages: GRPO's are one per
    sample; ppo.py's are per token, among `tokens`) and the trainers' per-token numbers."""
    detail = [] if batch is None or batch.detail is None else \
        [i for i in batch.detail.tolist() if i >= 0]
    advantages = batch.advantages if batch is not None and per_sample_advantages else None
    session.rollouts.train(step, sampled, cfg.num_generations, session.run.tokenizer, kept,
                           advantages, detail, tokens)


def after_update(session: Session, cfg, step: int, scored: "Scored", batch: TrainBatch,
                 update: dict, train_seconds: float, t_step: float, bad_steps: int,
                 **extra) -> int:
    """The rest of a step whose update is done -- ppo.py's and distill.py's (grpo.py, which drops
    and refills groups, spells it out): every sample and what the update computed of it (per
    token) to the rollout log, the guard against non-finite updates, the new weights to the
    engines, the step's record with `extra`, then end_step. Returns the bad steps in a row."""
    log_rollouts(session, cfg, step, scored, batch, update.pop("token_detail"),
                 per_sample_advantages=False)
    bad_steps = count_bad_steps(update, bad_steps, step, cfg.lr)
    sync_seconds = session.run.sync_weights(step)
    record = step_record(step, scored, update, train_seconds, sync_seconds, cfg.num_generations)
    record.update(**extra, reward_errors=session.reward_fns.errors,
                  step_seconds=time.time() - t_step)
    end_step(session, cfg, step, record, scored, save=not bad_steps)
    return bad_steps


def replayed(session: Session, step: int) -> tuple[Scored, Scored, list[bool]]:
    """--replay: step `step` of the saved run, as the loop's records -- every sample it drew, the
    ones it trained on, and which those are -- with the rewards it gave them (nothing is sampled
    or scored again)."""
    saved = session.replay[step]
    optional = lambda key: [r[key] for r in saved] if key in saved[0] else None  # noqa: E731
    comps = Completions([r["prompt_ids"] for r in saved], [r["completion_ids"] for r in saved],
                        [r["truncated"] for r in saved], [r["completion"] for r in saved],
                        optional("engine_logprobs"), min(r["policy_version"] for r in saved),
                        mask=[[bool(m) for m in r["mask"]] for r in saved] if "mask" in saved[0]
                        else None)
    episodes = [Episode(r["row"], None, r["episode"]["prompt"], r["prompt_ids"],
                        r["episode"]["messages"], r["completion_ids"],
                        [bool(m) for m in r["mask"]], r.get("engine_logprobs", []),
                        r["episode"]["turns"], r["episode"]["tool_calls"],
                        r["episode"]["tool_errors"], r["episode"]["tool_seconds"],
                        r["episode"]["done"], r["truncated"])
                for r in saved] if "episode" in saved[0] else []
    sampled = Scored([r["row"] for r in saved], comps, torch.tensor([r["reward"] for r in saved]),
                     [r["correct"] for r in saved] if saved[0]["correct"] is not None else [],
                     {name: [r["rewards"][name] for r in saved] for name in saved[0]["rewards"]},
                     episodes=episodes)
    kept = [r["kept"] for r in saved]
    return sampled, sampled.select([i for i, k in enumerate(kept) if k]), kept

