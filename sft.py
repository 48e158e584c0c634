"""SFT: supervised fine-tuning, in one file you can read top to bottom.

Given conversations, SFT maximises the likelihood of the model's own turns and nothing else:

    L = -(1 / N) sum_t m_t log pi(x_t | x_<t)       m_t = 1 on the model's tokens, N = sum_t m_t

over every token t of a step's sequences. The model's tokens are the assistant turns -- text and
tool calls, each with its end-of-turn token -- never the system, user or tool messages. The mask
comes from the rendered segments of each conversation, rendered as env.ToolChat renders GRPO's
episodes, so what SFT teaches is token for token what GRPO's turns look like and what its parser
reads.

Its place in the pipeline: SmolLM2-135M-Instruct never writes a tool call, so GRPO on the agentic
tasks has nothing to reinforce (docs/agents.md). A few minutes of SFT on a demonstrator's
transcripts teach it the format; the demonstrator plays weakly on purpose (data.DEMONSTRATORS),
so that GRPO, started from these weights, still has the strategy to learn:

    python sft.py                                              # CPU, offline: multiply warm start
    python sft.py --data guess --out out/sft-guess             # the guessing game's warm start
    python grpo.py --data guess --init-from out/sft-guess      # ... then RL from its weights
    python sft.py --model Qwen/Qwen2.5-0.5B-Instruct --data chats.jsonl --lora-rank 16

Data: TRL's SFT formats, unchanged -- `messages` (conversational: assistant `tool_calls`, `tool`
messages, and an optional `tools` column of JSON schemas), `prompt` + `completion` (strings, or
chat messages: only the completion's assistant turns are trained), or `text` (every token
trained); a .jsonl/.json/.csv/.parquet file or a hub dataset. Each sequence is a row of its own,
right-padded, in micro-batches of a token budget; with --packing, sequences are packed (best fit,
attention never crosses from one sequence to another, positions restart). What this file leaves
out on purpose: loss on anything but the model's tokens, NEFTune and other regularisers, and
sequence parallelism.
"""

import json
import random
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

import torch
from tqdm import tqdm

from attention import NAME as ATTENTION, prefix_layout, takes_layouts
from cli import check, parse_config
from data import DEMONSTRATORS, GENERATED, TASKS, TEMPLATES, InputError, Template
from data import demonstrations, load_rows, load_table
from env import Agent, ToolChat, environment_tools, load_environment, load_tools
from evaluate import evaluate_held_out
from formats import Sample, check_samples
from gpu_memory import PROMPT_TOKENS, Workload
from hardware import DTYPES, autocast
from logprobs import chunk_logprobs, right_pad
from model import full_weights, load_tokenizer, resolve
from options import EpisodeOptions, ModelOptions, OfflineOptions, RunOptions, TrainOptions, settle
from reward import Grader
from rollout import HF_BATCH, HFRollout, decoding_mode
from session import close_run, offline_loop, one_run, open_run, resume_driver, start_log
from trainer import export_model, micro_batches, optimizer_step, save_trainer
from trainer import setup_trainer


# (Last base first: model and data, episodes, optimisation, epochs, evaluation and checkpoints.)
@dataclass
class Config(RunOptions, OfflineOptions, TrainOptions, EpisodeOptions, ModelOptions):
    """The shared options (options.py), and SFT's:"""
    CONFIG_FILE: ClassVar[str] = "sft_config.json"
    lr: float = 5e-5
    warmup_steps: int = 2
    out: str = "out/sft"

    # SFT's data: a warm start's transcripts, or rows in TRL's formats (formats.py)
    data: str = "multiply"
    """a built-in warm start -- multiply, guess: a weak demonstrator's transcripts
    (data.DEMONSTRATORS) -- or a .jsonl/.json/.csv/.parquet file or hub dataset in a TRL format"""
    messages_field: str = "messages"
    """conversational rows: the column of chat messages (assistant tool_calls and tool messages
    included)"""
    prompt_field: str = "prompt"
    """prompt-completion rows: the prompt column (a string or chat messages; never trained)"""
    completion_field: str = "completion"
    """prompt-completion rows: the completion column (a string or chat messages)"""
    text_field: str = "text"
    """language-modelling rows: the text column (every token trained)"""
    tools_field: str = "tools"
    """the column of a row's tools as JSON schemas (optional: rows without it get --tools/--env)"""
    split: str = ""
    """hub datasets: the split (default: train)"""
    demos: int = 256
    """built-in warm starts: transcripts the demonstrator plays"""
    eval_rows: int = 32
    """rows held out (at most a tenth of the data) for the loss on data never trained on"""
    max_length: int = 1024
    """tokens per sequence, and per packed row; longer conversations are dropped, longer text cut,
    a prompt-completion row whose prompt alone fills it dropped (all counted)"""
    packing: bool = False
    """pack a step's sequences into rows of --max-length (best fit; attention stays within each
    sequence, positions restart) instead of one padded row each. Off by default, as in TRL: a
    packed row needs a dense (L x L) attention mask, which takes SDPA off its fused causal kernel,
    so packing pays only where padding would waste more (lengths that vary widely); on a CPU, 16
    multiply transcripts of ~275 tokens trained at 330 tokens/s packed, 510 unpacked"""
    max_tokens_per_microbatch: int | None = None
    """tokens (padding included) per forward/backward; gradients add up over the step (default:
    on a GPU what fits, gpu_memory.plan_memory; on a CPU 1024 -- SmolLM2-135M keeps ~1.2 MB of
    activations per token for backward: at 4096 `python sft.py` peaked at 8.8 GB)"""

    # The held-out task: greedy episodes (or answers) scored as grpo.py scores them
    eval_data: str | None = None
    """problems solved greedily every --eval-every steps: a task (multiply, guess, arith) or a
    file with problem and answer columns; default: the warm start's task, else none ("")"""
    eval_size: int = 64
    """held-out problems"""
    template: Template | None = None
    """prompt template of the held-out problems (default: the task's, else answer-is)"""
    chat: bool = True
    """held-out problems: wrap them in the model's chat template"""
    max_new_tokens: int | None = None
    """held-out problems: tokens per turn (default: the task's, else 48)"""

    def __post_init__(self):  # the task fills what is unset; impossible values stop here
        if self.eval_data is None:  # a warm start is measured on its task's held-out problems
            self.eval_data = self.data if self.data in DEMONSTRATORS else ""
        name = self.data if self.data in DEMONSTRATORS else self.eval_data
        task = TASKS[name] if name in GENERATED else None
        for field, default in (("template", "answer-is"), ("max_new_tokens", 48), ("tools", ""),
                               ("env", ""), ("max_turns", 4)):
            if getattr(self, field) is None:
                setattr(self, field, getattr(task, field) if task else default)
        settle(self, on_cpu={"gradient_checkpointing": False, "max_tokens_per_microbatch": 1024})
        check(self.data not in GENERATED or self.data in DEMONSTRATORS, f"--data {self.data}: "
              f"no built-in warm start for it (there are: {', '.join(DEMONSTRATORS)}); pass a file")
        for name in ("demos", "max_length", "eval_size"):
            check(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be at least 1")
        check(self.eval_rows >= 0, "--eval-rows must not be negative")

    def workload(self) -> Workload:
        """What this run puts on one GPU, for gpu_memory.plan_memory: the trainer, and the HF
        engine of the held-out evaluation (a batch of its problems' episodes)."""
        evaluates = bool(self.eval_data and self.eval_every)
        episode = PROMPT_TOKENS + max(self.max_new_tokens, self.max_episode_tokens)
        samples = min(self.eval_size, HF_BATCH)
        return Workload(resolve(self.model), self.lora_rank, self.dtype == "bf16", False, 1,
                        "hf" if evaluates else "", True, samples * episode, samples,
                        self.max_length, packed_row=self.max_length if self.packing else 0)


# ---------------------------------------------------------------------------------------------
# The loss: a pure function of the log-probs of every token and the mask of the model's own.


def sft_loss(logprobs, mask, num_tokens):
    """Negative log-likelihood of the masked tokens:

        L = -(1 / N) sum_{r, t} mask_rt log pi(x_rt | x_r,<t)

    logprobs, mask: (R, L), a micro-batch's rows (packed or not). N (num_tokens) counts the masked
    tokens of the whole step, not of this micro-batch: the micro-batches' losses then add up to
    the step's loss, however the step is cut into them."""
    mask = mask.to(logprobs.dtype)  # (R, L)
    return -(logprobs * mask).sum() / num_tokens  # ()


# ---------------------------------------------------------------------------------------------
# Data: rows in TRL's formats, checked before anything loads, then rendered into token segments.


@dataclass
class Example:
    """A sample as tokens: everything the model reads, and which of them it is trained to write."""
    ids: list[int]
    trained: list[bool]  # per token: in the loss (the first token never is: nothing predicts it)


def load_samples(cfg: Config, tools: list, env_class) -> tuple[list[Sample], str]:
    """The run's rows, checked: a demonstrator's transcripts, or a file's / hub dataset's rows."""
    run_tools = {fn.__name__ for fn in tools + (environment_tools(env_class()) if env_class
                                                else [])}
    if cfg.data in DEMONSTRATORS:
        def tools_for(row):  # one episode's tools, as the turn loop's: a fresh environment each
            env = env_class() if env_class else None
            if env is not None:
                env.reset(**row)
            return {fn.__name__: fn for fn in tools + (environment_tools(env) if env else [])}
        source = f"--data {cfg.data}"
        rows = demonstrations(cfg.data, cfg.demos, cfg.seed, tools_for)
    else:
        rows, source = load_table(cfg.data, cfg.split), cfg.data
    return check_samples(rows, source, cfg, run_tools), source


TURN_MARK = "\x00smolrl-turn\x00"  # stands for a turn's content, to find where the turn opens


def render_segments(render, messages: list[dict], trained_from: int, eos: str):
    """A conversation's text as the chat template renders it, cut into (text, trained) segments:
    every assistant turn from `trained_from` on -- what follows its opening, up to and including
    its end-of-turn token -- is trained; what lies between (the system prompt with the tools, the
    user's turns, tool results, the template's markers) is not. render(messages,
    generation_prompt) -> text. Rendered prefix by prefix, as an episode grows: each turn opens
    where the text so far, followed by a generation prompt, ends."""
    segments, done = [], ""
    for k, message in enumerate(messages):
        if message["role"] != "assistant" or k < trained_from:
            continue
        closed = render(messages[:k + 1], False)
        if k:
            opened = render(messages[:k], True)  # the conversation so far, and the turn's opening
        else:  # the conversation opens with it: no template renders an empty one (TRL trains it)
            marked = render([{"role": "assistant", "content": TURN_MARK}], False)
            if TURN_MARK not in marked:
                raise SystemExit("error: the chat template does not render a conversation that "
                                 "opens with the assistant's turn")
            opened = marked[:marked.index(TURN_MARK)]
        if not (opened.startswith(done) and closed.startswith(opened)
                and eos in closed[len(opened):]):
            raise SystemExit("error: the chat template renders a conversation differently once "
                             "it goes on (or ends an assistant turn without the end-of-turn token "
                             f"{eos!r}): SFT's segments would not be the episodes' turns")
        end = closed.index(eos, len(opened)) + len(eos)  # (the turn's text may not contain eos)
        segments += [(opened[len(done):], False), (closed[len(opened):end], True)]
        done = closed[:end]
    return segments


def encode(sample: Sample, tokenizer, render) -> Example:
    """Token ids of a sample, segment by segment -- an episode's ids are its prompt's, then each
    turn's and each tool result's, tokenized apart, and so are these -- and the mask of the
    model's own. Plain text: the prompt, then the completion closed with the end-of-turn token (as
    TRL adds it), which the model must learn to write."""
    if sample.messages:
        segments = render_segments(render, sample.messages, sample.trained_from,
                                   tokenizer.eos_token)
        pieces = [(tokenizer(text, add_special_tokens=False)["input_ids"], trained)
                  for text, trained in segments]
    else:
        completion = tokenizer(sample.completion, add_special_tokens=not sample.prompt)
        completion = completion["input_ids"]
        if not completion or completion[-1] != tokenizer.eos_token_id:
            completion = completion + [tokenizer.eos_token_id]
        prompt = tokenizer(sample.prompt)["input_ids"] if sample.prompt else []
        pieces = [(prompt, False), (completion, True)]
    ids = [t for piece, _ in pieces for t in piece]
    trained = [flag for piece, flag in pieces for _ in piece]
    return Example(ids, [False] + trained[1:])


def encode_samples(samples: list[Sample], tokenizer, tools: list, env_class, cfg: Config,
                   source: str) -> list[Example]:
    """Every sample as tokens, in the chat format of its tools: the run's (env.ToolChat, as its
    episodes), the row's own, or the model's plain chat template for a row without tools.
    Conversations longer than --max-length are dropped (cut, they would teach a turn that never
    ends), text is cut; both are counted."""
    run_chat = ToolChat(tokenizer, tools, env_class) if tools or env_class else None
    chats = {}

    def render_for(schemas):
        if schemas is None and run_chat:
            return run_chat.render
        if schemas:  # the row's own tools, in the chat format the run's would get
            key = json.dumps(schemas, sort_keys=True)
            if key not in chats:
                chats[key] = ToolChat(tokenizer, schemas).render
            return chats[key]
        if not tokenizer.chat_template:
            raise InputError(f"{source}: conversational rows need a model with a chat template")
        return lambda messages, generation_prompt: tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt)

    examples, cut, dropped, empty = [], 0, [], []
    for sample in tqdm(samples, desc="tokenizing", leave=False, disable=len(samples) < 1000):
        example = encode(sample, tokenizer, render_for(sample.tools) if sample.messages else None)
        if len(example.ids) > cfg.max_length and sample.messages:
            dropped.append((sample.row, len(example.ids)))
            continue
        if len(example.ids) > cfg.max_length:
            example = Example(example.ids[:cfg.max_length], example.trained[:cfg.max_length])
            if not any(example.trained):  # its prompt alone fills --max-length
                empty.append(sample.row)
                continue
            cut += 1
        examples.append(example)
    if cut or dropped or empty:
        longest = f" (row {dropped[0][0]}: {dropped[0][1]} tokens)" if dropped else ""
        print(f"{source}: {cut + len(dropped) + len(empty)} of {len(samples)} rows are longer "
              f"than --max-length {cfg.max_length} tokens: {cut} text rows cut, {len(dropped)} "
              f"conversations dropped{longest}, {len(empty)} rows dropped whose prompt alone "
              f"fills it (nothing left to train)")
    if not examples:
        why = f" (row {empty[0]}: its prompt alone fills them)" if empty else ""
        raise InputError(f"{source}: every row is longer than --max-length {cfg.max_length} "
                         f"tokens{why}")
    return examples


# ---------------------------------------------------------------------------------------------
# Packing: a step's sequences in as few rows as fit, each sequence attending to itself alone.


def best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing bin packing: longest first, each sequence into the fullest row it still
    fits in (a new row if none). Returns the indices in each row. A sequence longer than capacity
    gets a row of its own."""
    rows, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # (stable: ties by index)
        fits = [r for r in range(len(rows)) if room[r] >= lengths[i]]
        if fits:
            r = min(fits, key=lambda r: room[r])
        else:
            rows.append([])
            room.append(capacity)
            r = len(rows) - 1
        rows[r].append(i)
        room[r] -= lengths[i]
    return rows


@dataclass
class PackedRows:
    """Sequences laid out in rows for one forward pass."""
    input_ids: torch.Tensor  # (R, L) each row's sequences one after another, right-padded
    lengths: torch.Tensor  # (R,) tokens in each row, padding excluded
    trained: torch.Tensor  # (R, L) bool: in the loss
    positions: torch.Tensor | None = None  # (R, L) position ids, from 0 at every sequence's start
    segments: torch.Tensor | None = None  # (R, L) each token's sequence in its row (0, 1, ...),
    # -1 padding. Both None when every row holds one sequence: plain causal attention

    def select(self, idx) -> "PackedRows":
        """Rows idx, cut to the longest of them."""
        L = int(self.lengths[idx].max())
        cut = lambda t: None if t is None else t[idx, :L]  # noqa: E731
        return PackedRows(self.input_ids[idx, :L], self.lengths[idx], self.trained[idx, :L],
                          cut(self.positions), cut(self.segments))

    def to(self, device) -> "PackedRows":
        return PackedRows(*(None if t is None else t.to(device) for t in
                            (self.input_ids, self.lengths, self.trained, self.positions,
                             self.segments)))


def pack_rows(examples: list[Example], capacity: int | None, pad_id: int) -> PackedRows:
    """The examples in rows: packed by best_fit into rows of `capacity` tokens, or one a row
    (capacity None)."""
    rows = best_fit([len(e.ids) for e in examples], capacity) if capacity else \
        [[i] for i in range(len(examples))]
    seqs = [[examples[i] for i in row] for row in rows]
    ids = right_pad([[t for e in row for t in e.ids] for row in seqs], pad_id)
    lengths = torch.tensor([sum(len(e.ids) for e in row) for row in seqs])
    trained = right_pad([[f for e in row for f in e.trained] for row in seqs], False, torch.bool)
    if all(len(row) == 1 for row in rows):
        return PackedRows(ids, lengths, trained)
    positions = right_pad([[p for e in row for p in range(len(e.ids))] for row in seqs], 0)
    segments = right_pad([[s for s, e in enumerate(row) for _ in e.ids] for row in seqs], -1)
    return PackedRows(ids, lengths, trained, positions, segments)


def row_attention(model, rows: PackedRows, device) -> dict:
    """How the decoder keeps each packed sequence to itself, as its keyword arguments. Under
    smolrl's attention, where the model's layers take layouts, the sequences' places
    (attention.PrefixLayout: each sequence a prompt, causal over itself), and a mask of ones,
    which keeps transformers from making one from the positions that restart: no (L, L) mask
    anywhere. Otherwise a dense (R, 1, L, L) mask, which SDPA takes off its fused causal kernel
    (and on CUDA makes a bf16 bias of in every layer: the memory plan counts it,
    gpu_memory.Workload.packed_row)."""
    if rows.segments is None:
        return {}
    config = model.config.get_text_config()
    R, L = rows.segments.shape
    if config._attn_implementation == ATTENTION and takes_layouts(config):
        at = []  # (flat start, length) of every sequence
        for r in range(R):
            ids, counts = torch.unique_consecutive(rows.segments[r], return_counts=True)
            starts = torch.cumsum(counts, 0) - counts
            at += [(r * L + int(s), int(n)) for i, s, n in zip(ids, starts, counts) if i >= 0]
        layout = prefix_layout(at, [], R * L, device, heads=config.num_attention_heads)
        return {"attention_mask": torch.ones(R, L, dtype=torch.long, device=device),
                "prefix_layout": layout}
    q, k = rows.segments[:, :, None], rows.segments[:, None, :]  # (R, L, 1), (R, 1, L)
    causal = torch.ones(L, L, dtype=torch.bool).tril()  # (L, L)
    # Padding attends to itself only: a query that attends to nothing gives NaN in SDPA.
    mask = ((q == k) & (q >= 0) & causal) | torch.eye(L, dtype=torch.bool)  # (R, L, L)
    return {"attention_mask": mask[:, None].to(device)}


def token_logprobs(model, rows: PackedRows, device: str, bf16: bool, chunk_tokens: int = 2048):
    """(R, L) log-probs of every trained token (0 elsewhere) and the entropies (n,) at them: one
    decoder pass over the rows, then the head, fp32 log-softmax, chunk by chunk, on the trained
    positions only (logprobs.chunk_logprobs), so that a (R, L, V) tensor never exists."""
    attention = row_attention(model, rows, device)  # (from the rows on the host)
    rows = rows.to(device)
    with autocast(device, bf16 and next(model.parameters()).dtype == torch.float32):  # (LoRA)
        hidden = model.get_decoder()(input_ids=rows.input_ids, position_ids=rows.positions,
                                     use_cache=False, **attention).last_hidden_state  # (R, L, H)
        r, t = rows.trained.nonzero(as_tuple=True)  # (n,), (n,) one entry per trained token
        states = hidden[r, t - 1]  # (n, H): the state at t-1 predicts token t
        targets = rows.input_ids[r, t]  # (n,)
        parts = [chunk_logprobs(model, states[s:s + chunk_tokens], targets[s:s + chunk_tokens],
                                1.0, only_chunk=len(targets) <= chunk_tokens)
                 for s in range(0, len(targets), chunk_tokens)]
    logprobs = torch.zeros(rows.input_ids.shape, device=device)  # (R, L)
    logprobs = logprobs.index_put((r, t), torch.cat([lp for lp, _ in parts]))  # differentiable
    return logprobs, torch.cat([entropy for _, entropy in parts])


# ---------------------------------------------------------------------------------------------
# A step: pack, micro-batch, loss, backward; the optimizer step and the gradient clipping are
# trainer.py's, as in grpo.py.


def batch_loss(trainer, examples: list[Example], cfg: Config, train: bool) -> dict:
    """Forward (and with `train` backward) over a step's examples, packed and cut into micro-
    batches of --max-tokens-per-microbatch. Returns the step's sums: loss, tokens, entropy."""
    rows = pack_rows(examples, cfg.max_length if cfg.packing else None,
                     trainer.tokenizer.pad_token_id)
    num_tokens = int(rows.trained.sum())  # the whole step's: every micro-batch divides by it
    sums = {"loss": 0.0, "entropy": 0.0, "trained_tokens": num_tokens,
            "tokens": int(rows.lengths.sum()), "padded_tokens": 0}
    for idx in micro_batches(torch.arange(len(rows.lengths)), rows.lengths, cfg):
        mb = rows.select(idx)
        if not mb.trained.any():  # (its loss and gradient are 0: no forward for nothing)
            continue
        with torch.set_grad_enabled(train):
            logprobs, entropy = token_logprobs(trainer.compute, mb, trainer.device,
                                               cfg.dtype == "bf16")
            loss = sft_loss(logprobs, mb.trained.to(trainer.device), num_tokens)
        if train:
            loss.backward()
        sums["loss"] += float(loss.detach())
        sums["entropy"] += float(entropy.sum())
        sums["padded_tokens"] += mb.input_ids.numel()
    sums["entropy"] /= max(num_tokens, 1)
    return sums


def train_step(trainer, examples: list[Example], cfg: Config) -> dict:
    t0 = time.time()
    trainer.compute.train()
    sums = batch_loss(trainer, examples, cfg, train=True)
    grad_norm = optimizer_step(trainer, sums["loss"])  # clip, step, refresh the bf16 copy
    seconds = time.time() - t0
    return {**sums, "grad_norm": float("nan") if grad_norm is None else grad_norm,
            "lr": trainer.scheduler.get_last_lr()[0],
            "pad_frac": 1 - sums["tokens"] / sums["padded_tokens"], "step_seconds": seconds,
            "tokens_per_s": sums["tokens"] / seconds}


# ---------------------------------------------------------------------------------------------
# The loop.


@one_run
def main(cfg: Config):
    folder = open_run(cfg)
    # The data first, every row checked, rendered and measured: a bad file stops in seconds, before
    # the model loads (the tokenizer alone is needed).
    tools, env_class = load_tools(cfg.tools), load_environment(cfg.env)
    samples, source = load_samples(cfg, tools, env_class)
    examples = encode_samples(samples, load_tokenizer(cfg.model), tools, env_class, cfg, source)
    agent = Agent.for_run(cfg, TEMPLATES[cfg.template][0], tools, env_class)
    task_rows = load_rows(cfg.eval_data, limit=cfg.eval_size, need_answers=not env_class) \
        if cfg.eval_data and cfg.eval_every else []
    random.Random(cfg.seed).shuffle(examples)
    n_eval = min(cfg.eval_rows, len(examples) // 10)
    held_out, train = examples[:n_eval], examples[n_eval:]

    print(f"dtype {cfg.dtype} ({cfg.dtype_reason})")
    if cfg.memory_plan:
        print(cfg.memory_plan)
    trainer = setup_trainer(cfg, folder.resume_dir)  # on --resume, the checkpoint's state
    if cfg.packing and not getattr(trainer.model, "smolrl_shares_prompts", False):
        raise SystemExit(f"error: --packing: {type(trainer.model).__name__} was not verified to "
                         f"keep packed sequences apart with an attention mask; use --no-packing")
    resume_driver(folder)
    # The held-out task's engine decodes as a resumed run recorded (in bf16 another choice could
    # solve other problems greedily), and this run records how it decodes.
    engine = HFRollout(trainer.model, trainer.tokenizer, device=trainer.device,
                       dtype=DTYPES[cfg.dtype], decode=cfg.decoding) if task_rows else None
    start_log(folder, cfg, format_sft_step, decoding_mode(engine))
    offline_loop(folder, cfg, len(train), f"{len(train)} training rows, {n_eval} held-out rows, "
                 f"{len(task_rows)} held-out problems",
                 train_step=lambda rows: train_step(trainer, [train[i] for i in rows], cfg),
                 evaluate=held_out_evaluation(trainer, held_out, task_rows, engine, agent, cfg),
                 save=lambda checkpoint: save_trainer(trainer, checkpoint))
    close_run(folder, lambda model_dir: export_model(trainer, model_dir),
              title=f"SFT on {cfg.data} ({cfg.model})", train_keys=(),
              eval_keys=("eval_accuracy", "eval_tool_call_rate"), loss_keys=("loss", "eval_loss"))
    return folder.driver.history


def held_out_evaluation(trainer, held_out: list[Example], task_rows: list[dict], engine, agent,
                        cfg: Config):
    """The step's held-out metrics, as a function: the loss on the held-out rows, and the task
    solved greedily by `engine` holding the current weights, scored as grpo.py scores its
    held-out problems (evaluate.evaluate_held_out: episodes with --tools/--env)."""
    grader = Grader()  # (math-verify's workers start only if an answer needs them)
    run = SimpleNamespace(rollout=engine, tokenizer=trainer.tokenizer, agent=agent)

    def evaluate_now() -> dict:
        record, t0 = {}, time.time()
        if held_out:
            trainer.compute.eval()
            with torch.no_grad():
                record["eval_loss"] = batch_loss(trainer, held_out, cfg, train=False)["loss"]
        if task_rows:
            engine.update_weights(full_weights(trainer.model))
            record.update(evaluate_held_out(run, task_rows, cfg, grader)[0])
        record["eval_seconds"] = time.time() - t0
        return record
    return evaluate_now


def format_sft_step(r: dict) -> str:
    shown = ("step", "loss", "entropy", "grad_norm", "trained_tokens", "tokens_per_s",
             "eval_loss", "eval_accuracy", "eval_tool_call_rate", "eval_tool_error_rate",
             "eval_tool_calls", "eval_reward")
    return " | ".join(f"{k} {r[k]:.4g}" if isinstance(r[k], float) else f"{k} {r[k]}"
                      for k in shown if k in r)


if __name__ == "__main__":
    main(parse_config(Config, description=__doc__.split("\n")[0]))
