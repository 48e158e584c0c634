"""The options the algorithms share, declared once: groups of fields that each algorithm's Config
inherits (its command line, through cli.parse_config; docs/options.md, through
docs/make_options.py, both walk the bases), with the checks and the hardware choices that go with
them (`settle`: the dtype, the GPU memory plan).

    ModelOptions      the model, the seed                               every algorithm
    TrainOptions      optimiser, dtype, LoRA, checkpointing, compile    every algorithm
    RunOptions        evaluation cadence, output, trackers, checkpoints every algorithm
    EpisodeOptions    tools and environments                            sft.py and the RL loop
    OfflineOptions    epochs, steps and batches                         sft.py, dpo.py, rm.py
    PairOptions       preference pairs, their lengths and micro-batches dpo.py, rm.py
    RLOptions         the RL loop's: task, sampling, episodes, steps and micro-batches, held-out
                      problems, Ray                                     grpo.py, distill.py, ppo.py

An algorithm states a different default by declaring the field again without a docstring (the
group's docstring stays the one shown). dataclasses order the fields of several bases last base
first, so RLOptions lists its groups from the last shown to the first.
"""

import importlib.util
import math
from dataclasses import dataclass, fields
from typing import ClassVar, Literal

import torch

from checkpoint import recorded_setting
from cli import check, check_numbers, flag
from data import Template, apply_task
from evaluate import check_trackers
from gpu_memory import GiB, PROMPT_TOKENS, Workload, plan_memory
from hardware import DtypeChoice, choose_dtype, decode_pin, pick_device
from model import DEFAULT_MODEL, model_path
from pairs import ANSWER_TOKENS
from reward import weighted
from reward_models import frozen_models
from rollout import HF_BATCH


@dataclass
class ModelOptions:
    # Model and data
    model: str = DEFAULT_MODEL
    """model to train: the offline default, a hub id, or a local HF folder (a run's --out)"""
    seed: int = 0
    """seed for data order, sampling and initialisation"""


@dataclass
class TrainOptions:
    # Optimisation
    lr: float | None = None
    """AdamW learning rate, constant after warmup"""
    warmup_steps: int = 0
    """linear learning-rate warmup steps"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping norm; a step whose loss or gradient is not finite leaves the weights
    alone"""
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """compute dtype of the update (and of the KL reference, teacher and engine; master weights
    stay fp32); auto: bf16 where the hardware has it natively, else fp32 (hardware.choose_dtype,
    printed; a resumed run keeps the dtype it recorded)"""
    compile: bool = False
    """torch.compile the decoder layers for the update: 1.2-1.4x faster after a one-off ~45-60 s
    compile on a CPU (~10 s once cached on disk); pays off in runs longer than the default"""
    gradient_checkpointing: bool | None = None
    """recompute activations in backward: less memory for long sequences, ~30 % more compute
    (default: on a GPU when the memory plan needs it, gpu_memory.plan_memory; on a CPU off)"""
    lora_rank: int = 0
    """LoRA (peft): train rank-R adapters only, for a 1.5B model on a 24 GB GPU (0 = full
    fine-tuning); a KL reference is the base with the adapters off"""
    lora_alpha: int = 0
    """LoRA scale numerator (0 = 2 * rank)"""
    lora_targets: str = "all-linear"
    """LoRA: the modules adapted (comma-separated names, e.g. q_proj,v_proj; or all-linear)"""

    # GPU memory (gpu_memory.py)
    gpu_gb: float = 0
    """plan the memory of a GPU with this many GiB: with --dry-run on any machine, one without a
    GPU included (a bf16 GPU; shapes from the model's config, no weights read), it prints the plan
    or what does not fit and by how much; on a GPU, the share of it the run plans for (0 = all)"""

    ADAM_BETAS: ClassVar[tuple] = (0.9, 0.99)  # RL's (DeepSeekMath); dpo.py keeps TRL's 0.999
    HEAD: ClassVar[str] = "lm"  # the model trained: a causal LM, or "reward" (rm.py's)


@dataclass
class RunOptions:
    # Evaluation, logging and checkpoints
    eval_every: int | None = 5
    """held-out evaluation every N steps, at step 0 and at the end (0 = never)"""
    out: str = "out"
    """output folder: metrics.jsonl, curves.png, checkpoints/, the final model in model/ (an HF
    folder; --model and --init-from take the output folder itself)"""
    report_to: str = ""
    """also log metrics to: tensorboard, wandb (comma-separated; pip install them first)"""
    save_every: int = 0
    """write <out>/checkpoints/step_N every N steps (0 = never); the format is checkpoint.py's"""
    keep_last: int = 2
    """checkpoints kept (the oldest are deleted); 0 keeps all"""
    keep_superseded: int = 2
    """earlier runs and left branches with weights (a model/, checkpoints) kept in
    <out>/superseded/ (the oldest are deleted, said on the first screen); 0 keeps all"""
    resume: str = ""
    """continue a run exactly: `auto` (latest checkpoint in --out) or a checkpoint folder"""
    stop_grace: float = 25.0
    """after SIGTERM or Ctrl-C the run ends its step, checkpoints it and exits: the seconds it
    may take; past them it exits at once, its last checkpoint kept (keep it under the
    scheduler's grace before SIGKILL, e.g. Kubernetes' 30 s; 0 = no limit)"""

    CONFIG_FILE: ClassVar[str] = ""  # written to --out, and read back by a resumed run


@dataclass
class EpisodeOptions:
    # Agentic episodes (env.py): the model calls tools, over several turns
    tools: str | None = None
    """tools the model may call, comma-separated: calculator, python (sandboxed: sandbox.py), or
    module:function (TRL's tools=); default: the task's"""
    env: str | None = None
    """an environment, module:Class (TRL's environment_factory): reset(**row), its public methods
    as tools, get_reward(); default: the task's"""
    max_turns: int | None = None
    """episodes: assistant turns at most (a turn still calling a tool at the limit: truncated;
    default: the task's, 5 for guess, else 4)"""
    max_episode_tokens: int = 512
    """episodes: tokens after the prompt at most, tool results included (then truncated)"""


@dataclass
class OfflineOptions:
    # Epochs and batches
    epochs: int = 1
    """passes over the training rows"""
    steps: int = 0
    """optimizer steps in all, overriding --epochs (TRL's max_steps): the rows are gone through
    again, reshuffled, as often as it takes (0 = --epochs' worth)"""
    batch_size: int = 16
    """rows per optimizer step (an epoch is ceil(rows / batch_size) steps, its last batch short)"""


@dataclass
class PairOptions:
    # Preference pairs: TRL's preference format (formats.py), or sampled from the model
    data: str = "builtin"
    """`builtin` (the model's own arith answers: a right one preferred to a wrong one), a
    .jsonl/.json/.csv/.parquet file, or a hub dataset id"""
    prompt_field: str = "prompt"
    """the data's prompt column (a string or chat messages)"""
    chosen_field: str = "chosen"
    """the data's preferred-response column"""
    rejected_field: str = "rejected"
    """the data's dispreferred-response column"""
    split: str = ""
    """hub datasets: the split (default: train)"""
    eval_pairs: int = 32
    """preference pairs held out, to measure the pair accuracy on data never trained on"""
    template: Template = "answer-is"
    """prompt template of the builtin pairs (and of dpo.py's held-out task)"""
    chat: bool = True
    """wrap string prompts in the model's chat template"""
    builtin_problems: int = 256
    """builtin set: arith problems to sample answers for"""
    builtin_samples: int = 4
    """builtin set: answers sampled per problem (temperature 0.7)"""
    max_length: int = 512
    """prompt + response tokens; longer pairs lose prompt tokens first, then response tokens"""
    max_prompt_length: int = 256
    """prompt tokens kept (from the end) when a pair is too long"""
    micro_batch_size: int = 8
    """pairs per forward/backward (chosen and rejected go through one forward together)"""

    def __post_init__(self):  # impossible values stop here, before anything loads
        settle(self, on_cpu={"gradient_checkpointing": False})
        check(self.builtin_samples >= 2, "--builtin-samples must be at least 2 (a pair needs two "
              "answers)")

    def workload(self) -> Workload:
        """What a run on pairs (dpo.py, rm.py) puts on one GPU, for gpu_memory.plan_memory: the
        trainer, micro-batches of --micro-batch-size pairs x 2 sequences of up to --max-length
        tokens, and with the builtin pairs the HF engine that samples them (its own copy of the
        weights, in the compute dtype; dpo.py's held-out evaluation decodes on it too)."""
        builtin = self.data == "builtin"
        samples = min(self.builtin_problems * self.builtin_samples, HF_BATCH) if builtin else 0
        return Workload(model_path(self), self.lora_rank, self.dtype == "bf16", False, 1,
                        "hf" if builtin else "", True, samples * (PROMPT_TOKENS + ANSWER_TOKENS),
                        samples, self.max_length, head=self.HEAD,
                        microbatch_tokens=2 * self.micro_batch_size * self.max_length)


@dataclass
class ScaleOptions:
    # Scale-out: Ray placement (distributed.py) and engine memory
    num_trainers: int = 1
    """data-parallel trainer processes (>1, or --num-engines >1, runs on Ray: distributed.py)"""
    num_engines: int = 1
    """rollout engines; prompts are sharded across them"""
    colocate: bool = False
    """Ray: engines share the trainers' GPUs/CPUs instead of getting their own"""
    ray_address: str = ""
    """Ray: an existing cluster's address ("auto" on one of its nodes), or "local" to start one"""
    fsdp: bool = False
    """Ray, GPU: shard the model over the trainers with FSDP2 (for models that don't fit one GPU)"""
    gpu_memory_utilization: float | None = None
    """vLLM: fraction of GPU memory (of host memory on CPU) for weights and KV cache (default: on
    a GPU what holds one step's batch, gpu_memory.plan_memory; on a CPU 0.2)"""
    weight_sync: Literal["collective", "object-store"] = "collective"
    """Ray: trainer rank 0 broadcasts the weights to the engines (bf16, bucketed), or puts them in
    Ray's object store for every engine to pull"""


@dataclass
class RLLoopOptions:
    # Sampling: the rollouts of one step
    rollout: Literal["auto", "hf", "vllm"] = "auto"
    """generation engine: hf (a decoding loop over the HF model) or vllm (in-process vLLM, synced);
    auto: vllm when a GPU and vLLM are there, else hf"""
    prompts_per_step: int = 8
    """prompts sampled per step (N)"""
    num_generations: int = 8
    """completions per prompt: the group size G"""
    max_new_tokens: int | None = None
    """response length limit; responses that hit it are truncated (default: the task's)"""
    max_prompt_tokens: int = PROMPT_TOKENS
    """the longest prompt (tokens, chat template included) the GPU memory plan and a vLLM
    engine make room for; there a longer one stops the run in one line before any model loads"""
    temperature: float | None = None
    """sampling temperature for training rollouts; the log-probs use it too (default: the task's)"""
    top_p: float = 1.0
    """must stay 1: the trainer's log-probs describe the full distribution (see settle)"""

    # The update's schedule
    steps: int | None = None
    """optimizer steps, one rollout batch each when updates_per_rollout is 1 (default: the task's)"""
    updates_per_rollout: int = 1
    """optimizer steps per rollout batch; >1 makes the ratio and the clipping matter"""
    micro_batch_size: int | None = None
    """sequences per forward/backward; gradients accumulate over the batch (default: the task's,
    64 for arith's short sequences, else 16)"""
    max_tokens_per_microbatch: int | None = None
    """micro-batches by token budget (padded tokens), sequences sorted by length (0 = by count;
    default: on a GPU what fits, gpu_memory.plan_memory; on a CPU 0, distill.py's 1,024)"""
    init_from: str = ""
    """start a new run (fresh optimizer, step 0) from a checkpoint's or HF folder's weights"""

    # Held-out problems
    eval_data: str = ""
    """held-out problems (default: the task's eval set, else the last eval_size rows of --data)"""
    eval_size: int | None = None
    """number of held-out problems evaluated greedily (default: the task's)"""
    log_samples_every: int = 10
    """print a few sampled completions every N steps (0 = never)"""

    # The rollout log: <out>/rollouts.jsonl (rollout_log.py), and training on a saved one
    rollout_tokens: int = 1
    """groups a step whose per-token numbers (text pieces, log-probs, entropy, advantages) the
    rollout log keeps, those with a reward spread first (-1 = every sample); every sample's
    tokens, text, rewards and advantage are kept whatever it says"""
    replay: str = ""
    """train on the samples a run folder's rollouts.jsonl holds instead of sampling: the same
    batches in the same order, their saved rewards (change the loss, compare on the same data)"""


@dataclass
class TaskOptions:
    # Model and data
    data: str = "auto"
    """a task -- arith (offline), math, gsm8k; auto: arith for the offline default model, math for
    any other (data.TASKS) -- or a .jsonl/.json/.csv/.parquet file or hub dataset id"""
    task: Literal["", "arith", "math", "gsm8k", "custom", "multiply", "guess"] = ""
    """whose defaults apply (data.TASKS); "" = what --data says, a file by its columns"""
    prompt_field: str = ""
    """the data's prompt column (default: `problem`, else `prompt`)"""
    answer_field: str = "answer"
    """the data's reference-answer column (e.g. `solution`); optional if no reward needs it"""
    split: str = ""
    """hub datasets: the split to train on (default: the task's, else train)"""
    template: Template | None = None
    """prompt template from data.TEMPLATES: answer-is, boxed, raw (default: the task's)"""
    chat: bool = True
    """wrap prompts in the model's chat template (turn off for base models)"""
    reward: str | None = None
    """reward functions, comma-separated `name=weight`: correctness, format, or module:function
    (default: the task's; an --env's get_reward() is added to them)"""
    require_think_close: bool = False
    """reasoning models: grade only the text after </think>; no </think> means reward 0"""
    reward_model: str = ""
    """reward models added to --reward, comma-separated `path=weight`: a local folder or hub id of
    an AutoModelForSequenceClassification with one label, or rm.py's --out (TRL's
    reward_funcs="path"; reward_models.py); frozen, in the run's dtype"""
    judge: str = ""
    """generative judges added to --reward, comma-separated `model=weight`: a causal LM asked
    whether the completion is right, the reward its p(yes) / (p(yes) + p(no)) (reward_models.py)"""
    judge_prompt: str = ""
    """--judge's question: a text file holding {prompt} and {completion} (default:
    reward_models.JUDGE_PROMPT)"""


# (Last base first: model and data, sampling, episodes, the update, evaluation, scale-out.)
@dataclass
class RLOptions(ScaleOptions, RunOptions, TrainOptions, RLLoopOptions, EpisodeOptions, TaskOptions,
                ModelOptions):
    """The options of every algorithm that runs the RL loop (rl.py)."""
    lr: float | None = None
    """AdamW learning rate, constant after warmup (default: the task's)"""
    eval_every: int | None = None
    """held-out greedy evaluation every N steps, at step 0 and at the end (0 = never; default:
    the task's)"""

    # On a CPU, micro-batches by count: the GRPO update shares each prompt among its group.
    CPU_MICROBATCH_TOKENS: ClassVar[int] = 0

    def __post_init__(self):  # the task's defaults fill what is unset; impossible values stop here
        apply_task(self)
        if self.rollout == "auto":  # (--gpu-gb without a GPU plans the GPU command: vLLM's)
            gpu_and_vllm = torch.cuda.is_available() and importlib.util.find_spec("vllm")
            self.rollout = "vllm" if gpu_and_vllm or pretends_gpu(self) else "hf"
        settle(self, on_cpu={"gradient_checkpointing": False,
                             "max_tokens_per_microbatch": self.CPU_MICROBATCH_TOKENS,
                             "gpu_memory_utilization": 0.2})
        check(self.num_generations >= 2, f"--num-generations {self.num_generations}: a group needs "
              f"at least 2 samples, or it has no baseline to be better than")
        check(self.temperature > 0, f"--temperature {self.temperature}: training rollouts must "
              f"sample (the log-probs are divided by the temperature); greedy is for evaluation")
        # With top-p the engine samples from the nucleus, renormalised; the trainer's log-probs
        # describe the whole distribution, so every importance weight would sit below 1.
        check(self.top_p == 1.0, f"--top-p {self.top_p}: training rollouts sample from the full "
              f"distribution that the trainer's log-probs describe (top-p would renormalise over "
              f"the nucleus, which the trainer does not see); use top-p in evaluate.py")
        check(0 < self.gpu_memory_utilization <= 1, "--gpu-memory-utilization must be in (0, 1]")
        check(not (self.resume and self.init_from), "--resume continues a run, --init-from starts "
              "a new one from other weights: give one of them")
        check(not (self.fsdp and self.lora_rank), "--fsdp with --lora-rank is not supported: "
              "LoRA is for models that fit one device")
        check(not self.fsdp or self.num_trainers > 1, "--fsdp shards the model over several "
              "trainers: use it with --num-trainers N, N > 1")
        for spec, name in [(self.reward, "--reward"), (self.reward_model, "--reward-model"),
                           (self.judge, "--judge")]:
            for source, weight in weighted(spec, paths=name != "--reward"):
                check(math.isfinite(weight), f"{name} {source}: its weight is not a finite "
                      f"number (name=weight, e.g. {source}=0.5)" + (
                          "; a folder whose name holds '=' is given whole, or with its weight "
                          "(path=1)" if name != "--reward" else ""))
        check(self.rollout_tokens >= -1, f"--rollout-tokens {self.rollout_tokens}: groups a step "
              f"kept token by token: 0 or more, or -1 for every sample")

    def reference(self) -> bool:
        """Whether the trainers keep a frozen copy of the initial policy (a KL reference)."""
        return False

    def setup(self, resume_dir: str = "", group=None):
        """What one trainer process holds (trainer.setup_trainer's Trainer; ppo.py adds a critic)."""
        from trainer import setup_trainer
        return setup_trainer(self, resume_dir, self.reference(), group)

    def engine_logprobs(self) -> bool:
        """Whether the HF engine returns the log-prob of each token it samples (vLLM always does):
        when the update needs them, as an off-policy step's pi_old."""
        return False

    def on_ray(self) -> bool:
        return self.num_trainers > 1 or self.num_engines > 1 or bool(self.ray_address)

    def engine_shares_weights(self) -> bool:
        """Whether the HF engine decodes from the very tensors the trainer computes with
        (trainer.engine_beside): in the trainer's process -- one process, or on Ray with
        --colocate, engine i in trainer i's (no more engines than trainers; not with --async-steps,
        where the engines sample while the trainers change those tensors, nor --fsdp, where each
        trainer holds a shard of them); not under LoRA (its engine holds the merged weights); not
        with compiled layers (decoding's shapes would recompile)."""
        beside = not self.on_ray() or (self.colocate and self.num_engines <= self.num_trainers
                                       and not getattr(self, "async_steps", 0) and not self.fsdp)
        return self.rollout == "hf" and beside and not self.lora_rank and not self.compile

    def workload(self) -> Workload:
        """What this run puts on one GPU, for gpu_memory.plan_memory."""
        samples = self.prompts_per_step * self.num_generations
        new_tokens = self.max_episode_tokens if self.tools or self.env else self.max_new_tokens
        longest = self.max_prompt_tokens + new_tokens
        return Workload(model_path(self), self.lora_rank, self.dtype == "bf16",
                        self.reference() and not self.lora_rank,
                        self.num_trainers if self.fsdp else 1, self.rollout,
                        self.colocate or not self.on_ray(), samples * longest, samples, longest,
                        frozen=frozen_models(self.reward_model, self.judge),
                        engine_shares_weights=self.engine_shares_weights(),
                        moment_shards=1 if self.fsdp else self.num_trainers)


# ---------------------------------------------------------------------------------------------
# The checks and the hardware, for every algorithm's Config.

AT_LEAST_ONE = ("batch_size", "prompts_per_step", "max_new_tokens", "max_prompt_tokens",
                "updates_per_rollout", "micro_batch_size", "num_trainers", "num_engines",
                "max_turns", "max_episode_tokens", "epochs", "max_length", "max_prompt_length",
                "builtin_problems")
# Where infinity says "no limit" (the clip a ratio or a gradient gets, the grace a stop waits);
# every other number must be finite: an infinite learning rate or KL weight trains nothing.
MAY_BE_INFINITE = ("stop_grace", "eps_high", "seq_eps_high", "max_grad_norm", "value_clip",
                   "is_cap")
NOT_NEGATIVE = ("lr", "warmup_steps", "weight_decay", "eval_every", "save_every", "keep_last",
                "keep_superseded", "stop_grace",
                "lora_rank", "lora_alpha", "steps", "max_tokens_per_microbatch",
                "log_samples_every", "eval_pairs")


def pretends_gpu(cfg) -> bool:
    """--gpu-gb on a machine without a GPU: the run is planned as on a bf16 GPU of that size
    (parse_config lets it only print the plan: --dry-run)."""
    return bool(cfg.gpu_gb) and pick_device() != "cuda"


def settle(cfg, on_cpu: dict):
    """What every Config does after its own defaults are filled: `auto` dtype resolved (what
    computes fastest here; a resumed run keeps the dtype it recorded); on a GPU (or one --gpu-gb
    pretends), the memory settings left unset (None) chosen by the plan of cfg.workload(), on a
    CPU `on_cpu`'s; and the shared checks, before anything loads."""
    check_numbers(cfg, MAY_BE_INFINITE)
    check(cfg.gpu_gb >= 0, f"--gpu-gb {cfg.gpu_gb:g} must not be negative")
    recorded = recorded_setting(cfg.out, cfg.resume, cfg.CONFIG_FILE, "dtype")
    if pretends_gpu(cfg) and cfg.dtype == "auto" and not recorded:
        choice = DtypeChoice("bf16", f"--gpu-gb {cfg.gpu_gb:g}: planned for a GPU that computes "
                                     f"bf16 natively")
    else:
        choice = choose_dtype(cfg.dtype, pick_device(), recorded)
    cfg.dtype, cfg.dtype_reason = choice.name, choice.reason  # (the reason is no option)
    decode_pin()  # (SMOLRL_DECODE, read again where the engine starts: a bad value stops here)
    # How a resumed run's HF engine decoded (session.start_log): flash or not changes a bf16 run's
    # samples, and timed again the choice could flip; its engines keep it (trainer._rollout)
    cfg.decoding = recorded_setting(cfg.out, cfg.resume, cfg.CONFIG_FILE, "decoding")
    cfg.memory_plan = None  # on a GPU: what the unset memory settings are based on
    if pick_device() == "cuda" or cfg.gpu_gb:
        total = torch.cuda.mem_get_info()[1] if pick_device() == "cuda" else cfg.gpu_gb * GiB
        check(cfg.gpu_gb * GiB <= total, f"--gpu-gb {cfg.gpu_gb:g}: this GPU has "
              f"{total / GiB:.0f} GiB")
        cfg.memory_plan = plan_memory(cfg.workload(), int(cfg.gpu_gb * GiB or total),
                                      *(getattr(cfg, name, None) for name in (
                                          "gradient_checkpointing", "max_tokens_per_microbatch",
                                          "gpu_memory_utilization")))
        for name in on_cpu:
            setattr(cfg, name, getattr(cfg.memory_plan, name) or getattr(cfg, name))
    for name, value in on_cpu.items():
        if getattr(cfg, name) is None:
            setattr(cfg, name, value)
    names = {f.name for f in fields(cfg)}
    for name in names.intersection(AT_LEAST_ONE):
        check(getattr(cfg, name) >= 1, f"{flag(name)} must be at least 1")
    for name in names.intersection(NOT_NEGATIVE):
        check(getattr(cfg, name) >= 0, f"{flag(name)} must not be negative")
    check(cfg.max_grad_norm > 0, "--max-grad-norm must be positive")
    check_trackers(cfg.report_to)
