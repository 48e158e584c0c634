"""On-policy distillation: the student samples, the teacher grades every token.

GRPO's loop with the reward replaced by a teacher. Each step the student's engine samples G
completions of N prompts, exactly as in grpo.py; a frozen, stronger teacher (same tokenizer) reads
the very same tokens, and the student is trained to lower the divergence from the teacher's
next-token distribution at every sampled position:

    y ~ pi_s(. | x)                                                    the student's own samples
    D_t = KL(pi_s(. | x, y_<t) || pi_t(. | x, y_<t))                   reverse KL, per token
        = sum_v pi_s(v) [log pi_s(v) - log pi_t(v)]                    (exact, over the vocabulary)
    L   = sum_t D_t / (number of sampled tokens in the batch)          token-mean, as in grpo.py

Reverse KL on the student's samples is mode-seeking: the student is pushed off whatever the
teacher finds unlikely, where it actually goes. Against GRPO's one reward per sequence, every
token gets a graded signal -- the cheapest lesson in why dense rewards beat sparse ones. GKD
(Agarwal et al., 2024, "On-Policy Distillation of Language Models") generalises both choices, and
TRL's DistillationTrainer / GKDTrainer spell them as here:
    --jsd-beta b   the divergence: 1 reverse KL (above), 0 forward KL(pi_t || pi_s), between
                   the generalised JSD  b KL(pi_t || m) + (1 - b) KL(pi_s || m),
                   m = b pi_t + (1 - b) pi_s                              (GKD eq. 1; TRL's beta)
    --lmbda l      the fraction of steps the student samples; on the others the teacher samples
                   the batch (supervised KD on the teacher's sequences; GKD's lambda)

Everything else is grpo.py's: tasks and data, engines, episodes (--tools/--env: only the student's
own tokens are distilled), micro-batches, LoRA, Ray, checkpoints, metrics, held-out evaluation.
Rewards are still computed, for the metrics only: they do not train. Left out on purpose: a
teacher that does not share the student's tokenizer (cross-tokenizer distillation), top-k
teacher logits (the teacher's full distribution is computed here, a chunk of tokens at a time).

    python grpo.py && python distill.py --teacher out/grpo/model   # CPU: SmolLM2 learns arith
    python distill.py --model Qwen/Qwen2.5-0.5B-Instruct --teacher Qwen/Qwen2.5-7B-Instruct \\
        --data math                                                 # one GPU
"""

import functools
import random
import time
import types
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.utils.checkpoint import checkpoint

from cli import check, parse_config
from hardware import DTYPES, autocast, pick_device
from logprobs import check_head_logits, head_logits, length_mask
from model import load_model, load_tokenizer, resolve
from options import RLOptions
from rl import after_update, finish_session, sampling_seed, score, start_rollout, start_session
from rl import replayed, train_batch, with_detail
from session import one_run
from rollout import HFRollout, decoding_mode
from trainer import UpdateStats, any_rank_trains
from trainer import micro_batches, optimizer_step


@dataclass
class Config(RLOptions):
    """The RL loop's options (options.RLOptions: model and data, sampling, episodes, the update's
    schedule, evaluation, checkpoints, scale-out), and these:"""
    CONFIG_FILE: ClassVar[str] = "distill_config.json"
    # Each sample in its own padded row: 64 arith samples in one micro-batch held ~6 GB of the
    # student's activations on a CPU (10.5 GB in all); by 1,024 tokens, as sft.py.
    CPU_MICROBATCH_TOKENS: ClassVar[int] = 1024
    out: str = "out/distill"

    # Distillation
    teacher: str = ""
    """the model to distill (required): an HF folder -- e.g. grpo.py's --out, or its model/ -- or
    a hub id; it must use the student's tokenizer"""
    jsd_beta: float = 1.0
    """the divergence per token (TRL's beta): 1 reverse KL(student || teacher), on-policy
    distillation; 0 forward KL(teacher || student); between: GKD's generalised JSD"""
    lmbda: float = 1.0
    """GKD's lambda: the fraction of steps whose batch the student samples (on-policy); the
    teacher samples the others"""

    def __post_init__(self):
        check(bool(self.teacher), "--teacher is missing: distill.py needs the model to distill, "
              "e.g. --teacher out/grpo/model (what `python grpo.py` trained)")
        super().__post_init__()
        check(0 <= self.jsd_beta <= 1, f"--jsd-beta {self.jsd_beta}: must be in [0, 1] (0 "
              f"forward KL, 1 reverse KL, between: generalised JSD)")
        check(0 <= self.lmbda <= 1, f"--lmbda {self.lmbda}: a fraction of steps, in [0, 1]")
        check(not self.fsdp, "--fsdp is not supported by distill.py (the teacher is not sharded)")

    def setup(self, resume_dir: str = "", group=None):
        """The RL loop's trainer, and its teacher loaded now, with the student: --teacher may
        lie in this run's own --out, whose model/ the run moves aside before it writes."""
        trainer = super().setup(resume_dir, group)
        teacher_of(trainer)
        return trainer

    def workload(self):
        """The RL loop's, and the teacher beside the trainer for the whole run (grading; the
        steps it samples share it)."""
        run = super().workload()
        return run._replace(frozen=run.frozen + (("teacher", resolve(self.teacher, "--teacher"),
                                                  "lm"),))


# ---------------------------------------------------------------------------------------------
# The loss: a divergence per token, a pure function of two log-distributions.


def token_divergence(student_logprobs, teacher_logprobs, beta: float = 1.0):
    """D_t between the student's and the teacher's next-token distributions, per position.

    student_logprobs, teacher_logprobs: (n, V) log pi(v) at each of n sampled positions.
        beta = 1   KL(pi_s || pi_t) = sum_v pi_s (log pi_s - log pi_t)        reverse (on-policy)
        beta = 0   KL(pi_t || pi_s) = sum_v pi_t (log pi_t - log pi_s)        forward (supervised)
        else       beta KL(pi_t || m) + (1 - beta) KL(pi_s || m),  m = beta pi_t + (1 - beta) pi_s
    Returns (n,). The gradient flows through the student's log-probs only.
    """
    s, t = student_logprobs, teacher_logprobs.detach()  # (n, V)
    if beta == 1.0:
        return (s.exp() * (s - t)).sum(-1)  # (n,)
    if beta == 0.0:
        return (t.exp() * (t - s)).sum(-1)  # (n,)
    b = torch.tensor(beta, dtype=s.dtype, device=s.device)
    log_m = torch.logsumexp(torch.stack([t + b.log(), s + (1 - b).log()]), dim=0)  # (n, V)
    kl_t = (t.exp() * (t - log_m)).sum(-1)  # (n,) KL(pi_t || m)
    kl_s = (s.exp() * (s - log_m)).sum(-1)  # (n,) KL(pi_s || m)
    return beta * kl_t + (1 - beta) * kl_s  # (n,)


@dataclass
class TokenScores:
    """What distillation knows about each sampled token of a micro-batch, flattened: (n,) each."""
    divergence: torch.Tensor  # D_t, differentiable (the loss)
    reverse_kl: torch.Tensor  # KL(pi_s || pi_t) whatever --jsd-beta is: the metric
    student_logprob: torch.Tensor  # log pi_s(y_t), the sampled token
    teacher_logprob: torch.Tensor  # log pi_t(y_t)
    entropy: torch.Tensor  # the student's
    rows: torch.Tensor  # which completion of the micro-batch
    cols: torch.Tensor  # which of its tokens


def sampled_states(model, input_ids, prompt_lens, completion_lens):
    """The decoder's final hidden state that predicts each completion token -- the state at t-1
    predicts token t -- flattened: (hidden (n, H), rows (n,), cols (n,), targets (n,)), token
    `cols` of completion `rows` being `targets`. input_ids (B, L) right-padded: causal attention
    never looks at the padding after a row, so no mask is needed."""
    mask = length_mask(completion_lens, int(completion_lens.max()))  # (B, T)
    rows, cols = mask.nonzero(as_tuple=True)  # (n,), (n,)
    pos = prompt_lens[rows] + cols  # (n,) where each completion token is in input_ids
    hidden = model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
    return hidden[rows, pos - 1], rows, cols, input_ids[rows, pos]


def score_tokens(student, teacher, mb, cfg, device, chunk_tokens: int = 256) -> TokenScores:
    """Both models on micro-batch `mb` (a grpo.TrainBatch): each runs its decoder once (each
    sample in its own row: no prompt sharing here, for a loop a student can follow); the two LM
    heads run a chunk of positions at a time, log-softmax in fp32 at the sampling temperature, and
    backward recomputes a chunk's logits rather than keeping them, so no (n, V) tensor of the
    micro-batch is ever held."""
    L = int((mb.prompt_lens + mb.completion_lens).max())
    ids = mb.input_ids[:, :L]
    mixed = cfg.dtype == "bf16" and next(student.parameters()).dtype == torch.float32  # (LoRA)
    with autocast(device, mixed):
        hidden, rows, cols, targets = sampled_states(student, ids, mb.prompt_lens,
                                                     mb.completion_lens)
    with torch.no_grad():
        teacher_hidden = sampled_states(teacher, ids, mb.prompt_lens, mb.completion_lens)[0]

    def chunk(h, teacher_h, picked):  # (c, H), (c, H), (c, 1) -> five (c,) tensors
        with autocast(device, mixed):
            logits = head_logits(student, h)  # (c, V) fp32
        with torch.no_grad():
            teacher_logits = head_logits(teacher, teacher_h)  # (c, V) fp32
        V = min(logits.shape[-1], teacher_logits.shape[-1])  # (padded vocabularies differ)
        s_lp = torch.log_softmax(logits[:, :V] / cfg.temperature, -1)  # (c, V)
        t_lp = torch.log_softmax(teacher_logits[:, :V] / cfg.temperature, -1)  # (c, V)
        with torch.no_grad():
            reverse, entropy = token_divergence(s_lp, t_lp, 1.0), -(s_lp.exp() * s_lp).sum(-1)
            s_picked, t_picked = s_lp.gather(-1, picked)[:, 0], t_lp.gather(-1, picked)[:, 0]
        return token_divergence(s_lp, t_lp, cfg.jsd_beta), reverse, s_picked, t_picked, entropy

    parts = [checkpoint(chunk, hidden[s:s + chunk_tokens], teacher_hidden[s:s + chunk_tokens],
                        targets[s:s + chunk_tokens, None], use_reentrant=False)
             for s in range(0, len(targets), chunk_tokens)]
    return TokenScores(*(torch.cat(p) for p in zip(*parts)), rows, cols)


# ---------------------------------------------------------------------------------------------
# The training step: the divergence over the student's own sampled tokens.


def train_on_rollout(trainer, batch) -> dict:
    """`updates_per_rollout` optimizer steps on (this rank's shard of) one batch of samples, as
    grpo.train_on_rollout does, with the teacher's divergence as the loss. Returns raw sums
    (trainer.UpdateStats) that trainer.finish_metrics combines over ranks."""
    cfg, student, device = trainer.cfg, trainer.compute, trainer.device
    teacher = teacher_of(trainer)
    batch = batch.to(device)
    keep = (batch.completion_lens > 0).nonzero().flatten()
    mbs = micro_batches(keep, batch.prompt_lens + batch.completion_lens, cfg)  # (no FSDP here)
    stats = UpdateStats(trainer, batch, keep)
    if not any_rank_trains(trainer, len(keep)):
        return stats.result()
    for update in range(cfg.updates_per_rollout):
        student.train()
        for idx in mbs:
            mb = batch.select(idx)
            scores = score_tokens(student, teacher, mb, cfg, device)
            # The model's own tokens only: an episode's tool results are the environment's.
            mask = torch.ones_like(scores.divergence) if mb.token_mask is None else \
                mb.token_mask[scores.rows, scores.cols].float()  # (n,)
            loss = (scores.divergence * mask).sum() / batch.denom  # token-mean, global batch
            loss.backward()  # micro-batches add up to the batch's loss
            tokens = mask.sum().clamp(min=1)
            stats.add(loss, {key: float((getattr(scores, key) * mask).sum() / tokens) for key in
                             ("reverse_kl", "student_logprob", "teacher_logprob")},
                      scores.entropy, mask)
            if update == 0:  # each token's scores, for the rollout log's detail rows
                where, T = (scores.rows.cpu(), scores.cols.cpu()), int(mb.completion_lens.max())

                def by_row(x):  # (n,) -> (b, T)
                    return torch.zeros(len(idx), T).index_put(where, x.detach().float().cpu())
                stats.keep_tokens(batch, idx, logprob=by_row(scores.student_logprob),
                                  entropy=by_row(scores.entropy),
                                  teacher_logprob=by_row(scores.teacher_logprob),
                                  reverse_kl=by_row(scores.reverse_kl))
        stats.end_update(optimizer_step(trainer, stats.update_loss))
    return stats.result()


def teacher_of(trainer):
    """The frozen teacher of this trainer's process (under Ray, each trainer's own)."""
    return load_teacher(trainer.cfg.teacher, trainer.device, DTYPES[trainer.cfg.dtype])


@functools.cache
def load_teacher(path: str, device: str, dtype: torch.dtype):
    """The teacher, frozen, in the run's compute dtype, read straight onto the device in it (a
    7B teacher in fp32 would be 28 GiB before its cast); loaded once per process, so that the
    steps it samples (--lmbda < 1) and the grading share this one copy."""
    teacher = load_model(path, device, dtype)[0]
    check_head_logits(teacher)  # its own head and prompt-sharing verdict (in fp32: see there)
    teacher.requires_grad_(False)
    return teacher.eval()


def check_teacher(cfg):
    """Before the student loads: the teacher can be found and read, and its tokenizer is the
    student's (the divergence compares their distributions token id by token id)."""
    from transformers import AutoConfig
    path = resolve(cfg.teacher, "--teacher")
    try:
        AutoConfig.from_pretrained(path, trust_remote_code=False)
        theirs = load_tokenizer(path)
    except Exception as e:
        why = (str(e).splitlines() or [""])[0][:200]
        raise SystemExit(f"error: --teacher {cfg.teacher}: cannot be loaded "
                         f"({type(e).__name__}: {why})") from None
    ours = load_tokenizer(cfg.model)
    differ = len(set(ours.get_vocab().items()) ^ set(theirs.get_vocab().items()))
    if differ or ours.eos_token_id != theirs.eos_token_id:
        raise SystemExit(f"error: --teacher {cfg.teacher} and --model {cfg.model} do not share a "
                         f"tokenizer ({differ} token ids differ, eos {theirs.eos_token_id} vs "
                         f"{ours.eos_token_id}): distillation compares their next-token "
                         f"distributions id by id; pick a teacher of the student's family")


# ---------------------------------------------------------------------------------------------
# The loop: the RL loop (rl.py), with the teacher in place of advantages.


@one_run
def main(cfg: Config):
    check_teacher(cfg)  # before the student loads
    if cfg.lmbda < 1 and not cfg.replay and cfg.on_ray():  # the driver's own copy, for the
        # steps the teacher samples, read before the run moves anything in --out (in one process
        # it is the trainer's, loaded by Config.setup)
        load_teacher(cfg.teacher, pick_device(), DTYPES[cfg.dtype])
    session = start_session(cfg, train_on_rollout, line=format_step)
    run, driver, problems = session.run, session.driver, session.problems
    N, bad_steps, teacher_run = cfg.prompts_per_step, 0, None
    for step in range(driver.step + 1, cfg.steps + 1):
        t_step = time.time()
        # 1. Samples: the student's (on-policy), or with --lmbda < 1 on some steps the teacher's.
        on_policy = random.Random(cfg.seed * 1_000_003 + step).random() < cfg.lmbda
        if not on_policy and not session.replay:
            teacher_run = teacher_run or teacher_engine(cfg, run)
        if session.replay:  # --replay: a saved run's samples (rollout_log.py)
            scored = replayed(session, step)[1]
        else:
            seed = sampling_seed(cfg, step, 0)
            started = start_rollout(run if on_policy else teacher_run, problems.take(N), cfg,
                                    seed)
            scored = score(started, cfg, session.reward_fns, session.grader)  # (metrics only)
        # 2. The teacher grades every sampled token; the student steps towards it.
        t0 = time.time()
        zeros = torch.zeros(len(scored.completions))  # (no advantages: the divergence trains)
        batch = with_detail(train_batch(scored.completions, zeros, cfg,
                                        run.tokenizer.pad_token_id), scored.rewards, cfg)
        update = run.train(batch)
        train_seconds = time.time() - t0
        # 3. Every sample and the teacher's per-token scores of it to rollouts.jsonl; the engine
        # takes the new weights. 4. Metrics, evaluation, samples, checkpoint.
        bad_steps = after_update(session, cfg, step, scored, batch, update, train_seconds, t_step,
                                 bad_steps, on_policy=int(on_policy))
    finish_session(session, title=f"distillation of {cfg.teacher} on {cfg.data}",
                   train_keys=("reward", "accuracy"), loss_keys=("reverse_kl",))
    return driver.history


def teacher_engine(cfg, run):
    """--lmbda < 1: an engine over the teacher, for the steps whose batch it samples; the rest of
    the run (episodes, tokenizer) is the student's."""
    teacher = load_teacher(cfg.teacher, pick_device(), DTYPES[cfg.dtype])  # (the grader's)
    # frozen: it samples from the very same weights; it decodes as the student's engine does (as
    # the run chose, rollout.decoding_mode: a resumed run's teacher too)
    engine = HFRollout(teacher, run.tokenizer, device=pick_device(), dtype=DTYPES[cfg.dtype],
                       shares_weights=True, decode=decoding_mode(run.rollout))
    return types.SimpleNamespace(rollout=engine, agent=run.agent, tokenizer=run.tokenizer)


def format_step(r: dict) -> str:
    """The line distill.py prints for each step (and for its step-0 evaluation)."""
    if r["step"] == 0:
        return f"step    0 | held-out accuracy {r['eval_accuracy']:.3f} (greedy)"
    accuracy = f" acc {r['accuracy']:.3f}" if "accuracy" in r else ""
    line = (f"step {r['step']:4d} | {'student' if r['on_policy'] else 'teacher'} samples: reward "
            f"{r['reward']:.3f}{accuracy} len {r['completion_len']:.1f} | loss {r['loss']:.4f}")
    if "reverse_kl" in r:
        line += (f" reverse KL {r['reverse_kl']:.4f} logp student {r['student_logprob']:.3f} "
                 f"teacher {r['teacher_logprob']:.3f}")
    line += f" | gen {r['gen_seconds']:.1f}s train {r['train_seconds']:.1f}s"
    if "eval_accuracy" in r:
        line += f" | held-out {r['eval_accuracy']:.3f}"
    return line


if __name__ == "__main__":
    # The importable module, not __main__: Ray ships distill.train_on_rollout to its workers.
    import distill
    distill.main(parse_config(distill.Config, description=__doc__.split("\n")[0]))
