"""Learned rewards, as reward sources beside reward.py's functions (grpo.py's --reward-model and
--judge): a reward model's score, and a generative judge's probability of "yes".

    --reward-model PATH[=WEIGHT],...   an AutoModelForSequenceClassification with one label: a hub
                                       id, an HF folder, rm.py's output folder (TRL's
                                       `reward_funcs="path/or/hub-id"`)
    --judge MODEL[=WEIGHT],...         any causal LM, asked whether the completion is right: the
                                       reward is p(yes) / (p(yes) + p(no)) at its answer
                                       (LLM-as-judge, GenRM); --judge-prompt FILE for the question

Both read the conversation as the policy had it -- the prompt (a string prompt through the run's
template, as the policy saw it) and the decoded completion -- re-tokenized by their own tokenizer
and chat template, as TRL does; they are frozen, in the run's dtype, and score in batches.

A reward model reads what rm.py trained it on, through the same two functions: `reward_model_ids`
renders a conversation (the whole of it, its last turn closed, as TRL renders it on both sides)
and `scores` reads the score at each sequence's last token, found from its length -- never from
the pad id (a hub model's config.pad_token_id need not be its tokenizer's pad id).
"""

import json
import re
from pathlib import Path

import torch

from data import TEMPLATES
from hardware import autocast, pick_device
from logprobs import head_logits, right_pad, share_prompts
from model import check_reward_head, load_model, resolve
from reward import weighted

BATCH = 16  # sequences a judge asks about together
TOKENS = 8192  # a learned reward's forward: its sequences' tokens together, at the most
JUDGE_PROMPT = ("Here is a question and an answer to it.\n\nQuestion: {prompt}\n\n"
                "Answer: {completion}\n\nIs the answer correct? Reply with yes or no.")


def learned_rewards(reward_models: str, judges: str, judge_prompt: str, template: str,
                    dtype: torch.dtype) -> list[tuple]:
    """(name, scoring function, weight) for every --reward-model and --judge, loaded now."""
    sources = []
    for (path, weight), kind in [(s, RewardModel) for s in weighted(reward_models, True)] + \
                                [(s, Judge) for s in weighted(judges, True)]:
        source = kind(path, template, dtype, judge_prompt)
        sources.append((source.name, source, weight))
    return sources


def check_learned_rewards(reward_models: str, judges: str, judge_prompt: str):
    """Before any model loads: every --reward-model is a sequence-classification model with one
    label and a trained head in its weights, every --judge a causal LM, --judge-prompt a file with
    {prompt} and {completion}; one line naming the flag and the path otherwise."""
    for path, _ in weighted(reward_models, paths=True):
        config = _config(path, "--reward-model")
        kinds = config.get("architectures") or []
        if not any(k.endswith("ForSequenceClassification") for k in kinds) or \
                len(config.get("id2label") or {"0": ""}) != 1:
            raise SystemExit(f"error: --reward-model {path}: not a reward model (a sequence-"
                             f"classification model with one label; its config says "
                             f"{', '.join(kinds) or 'no architecture'}): train one with rm.py")
        check_reward_head(path, "--reward-model")  # (its head's weights there, not a random one)
    for path, _ in weighted(judges, paths=True):
        kinds = _config(path, "--judge").get("architectures") or []
        if not any(k.endswith("ForCausalLM") for k in kinds):
            raise SystemExit(f"error: --judge {path}: not a causal language model (its config "
                             f"says {', '.join(kinds) or 'no architecture'})")
    if judge_prompt:
        if not Path(judge_prompt).is_file():
            raise SystemExit(f"error: --judge-prompt {judge_prompt}: no such file")
        text = Path(judge_prompt).read_text()
        if "{prompt}" not in text or "{completion}" not in text:
            raise SystemExit(f"error: --judge-prompt {judge_prompt}: the question must hold "
                             f"{{prompt}} and {{completion}}")


def ask(question: str, prompt: str, completion: str) -> str:
    """The judge's question with {prompt} and {completion} filled, in one pass: other braces (a
    JSON example, \\boxed{}) stay as written, and a completion that writes "{prompt}" is not
    filled again."""
    said = {"{prompt}": prompt, "{completion}": completion}
    return re.sub(r"\{prompt\}|\{completion\}", lambda m: said[m.group(0)], question)


class RewardModel:
    """A reward model's score of prompt + completion, read as it was trained (rm.py, TRL): the
    conversation through reward_model_ids, the score through scores."""

    def __init__(self, path: str, template: str, dtype, _judge_prompt=""):
        found = check_reward_head(path, "--reward-model")  # (a random head would score noise)
        self.name = f"rm:{Path(found).name if Path(path).exists() else path}"
        self.model, self.tokenizer = load_model(path, pick_device(), dtype, head="reward")
        self.model.requires_grad_(False).eval()
        self.template = template

    @torch.no_grad()
    def __call__(self, prompts, completions, **_) -> list[float]:
        ids = [reward_model_ids(self.tokenizer, conversation(p, c, self.template))
               for p, c in zip(prompts, completions)]
        # As the policy's forward runs a group: its prompt once, then each sample's own tokens
        shared = group_prefix_lens(ids, [repr(p) for p in prompts])
        out = []
        for part in token_batches([len(i) for i in ids], TOKENS):
            out += scores(self.model, [ids[i] for i in part], self.model.device,
                          self.tokenizer.pad_token_id, bf16=False,
                          shared_lens=[shared[i] for i in part]).tolist()
        return out


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many first tokens a and b have in common."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def group_prefix_lens(ids: list[list[int]], keys: list[str]) -> list[int]:
    """How many first tokens each sequence has in common with every other of its key (the samples
    of one prompt: a GRPO group), which scores then runs once; 0 for a sequence alone."""
    rows: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        rows.setdefault(key, []).append(i)
    out = [0] * len(ids)
    for group in rows.values():
        n = min(common_prefix(ids[group[0]], ids[i]) for i in group[1:]) if len(group) > 1 else 0
        for i in group:
            out[i] = n
    return out


def token_batches(lengths: list[int], budget: int) -> list[range]:
    """Consecutive runs of sequences (a group's samples stay together where they fit) whose
    lengths sum to at most `budget` -- one sequence at the least."""
    out, start, total = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and total + n > budget:
            out.append(range(start, i))
            start, total = i, 0
        total += n
    return out + ([range(start, len(lengths))] if lengths else [])


class Judge:
    """A causal LM asked a yes/no question about the completion: the reward is its probability of
    "yes" against "no" at the first token of its answer (both spellings, "yes" and "Yes")."""

    def __init__(self, path: str, template: str, dtype, judge_prompt: str = ""):
        self.name = f"judge:{Path(path).name or path}"
        self.model, self.tokenizer = load_model(path, pick_device(), dtype)
        self.model.requires_grad_(False).eval()
        self.template = template
        self.question = Path(judge_prompt).read_text() if judge_prompt else JUDGE_PROMPT
        first = lambda word: self.tokenizer(word, add_special_tokens=False)["input_ids"][0]
        self.yes = sorted({first("yes"), first("Yes")})
        self.no = sorted({first("no"), first("No")})

    @torch.no_grad()
    def __call__(self, prompts, completions, **_) -> list[float]:
        asked = []
        for p, c in zip(prompts, completions):
            messages = conversation(p, c, self.template)
            question = ask(self.question, _text(messages[:-1]), _text(messages[-1:]))
            asked.append(_render(self.tokenizer, [{"role": "user", "content": question}], True))
        out = []
        for s in range(0, len(asked), BATCH):
            ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"]
                   for t in asked[s:s + BATCH]]
            batch = _right_padded(ids, self.tokenizer.pad_token_id, self.model.device)
            # The decoder alone, then the head at one position a row: the model's own forward
            # would build (b, L, V) logits -- ~125 GB in fp32 for 16 rows of 8.6K tokens at
            # Qwen's vocabulary. Right padding needs no attention mask (causal attention never
            # looks at the later pad), as in logprobs.completion_logprobs.
            hidden = self.model.get_decoder()(input_ids=batch["input_ids"],
                                              use_cache=False).last_hidden_state  # (b, L, H)
            rows = torch.arange(len(ids), device=hidden.device)  # (b,)
            last = torch.tensor([len(i) - 1 for i in ids], device=hidden.device)  # (b,) from
            # the lengths: the last real token's state predicts the answer's first token
            logits = head_logits(self.model, hidden[rows, last])  # (b, V) fp32
            logp = torch.log_softmax(logits, -1)  # (b, V)
            yes, no = logp[:, self.yes].logsumexp(-1), logp[:, self.no].logsumexp(-1)  # (b,)
            out += torch.sigmoid(yes - no).tolist()  # p(yes) / (p(yes) + p(no))
        return out


def conversation(prompt, completion, template: str) -> list[dict]:
    """The messages a learned reward reads: the prompt as the policy saw it (a string through the
    run's template) and the completion as the assistant's (an episode: all its messages)."""
    if isinstance(prompt, list):
        messages = list(prompt)
    else:
        messages = [{"role": "user", "content": TEMPLATES[template][0].format(problem=prompt)}]
    if isinstance(completion, list):
        return messages + completion
    return messages + [{"role": "assistant", "content": completion}]


def reward_model_ids(tokenizer, messages: list[dict]) -> list[int]:
    """What a reward model reads of a conversation, in training (rm.py) and in scoring
    (RewardModel): the whole conversation rendered by its tokenizer's chat template (the texts one
    after another without one), tokenized as the template wrote it -- no special tokens added --
    with its trailing pad ids dropped.

    Whole, its last turn closed by the template whether the response stopped or was cut: that is
    how TRL reads a conversation on both sides -- RewardTrainer trains on
    apply_chat_template(prompt + chosen), GRPOTrainer scores apply_chat_template(prompt +
    completion) -- and how a policy's completion cut at --max-new-tokens is scored. So a response
    cut at --max-length, or a builtin answer cut at the 32 tokens it was sampled to, is trained in
    that form too: were it trained without its end of turn, the model could learn "no end of
    turn" as the mark of a rejected answer, a form it never sees when it scores. Trailing pad ids
    are dropped because transformers' own forward reads the last token that is not the pad
    (SmolLM2's pad is its end-of-turn token): it then reads the token `scores` reads."""
    text = _render(tokenizer, messages, False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    while len(ids) > 1 and ids[-1] == tokenizer.pad_token_id:
        ids = ids[:-1]
    return ids


def scores(model, sequences: list[list[int]], device, pad_id: int, bf16: bool,
           shared_lens: list[int] | None = None):
    """(B,) the reward model's score of each sequence: the decoder's state at its last token (found
    from its length, not from the pad: a model's config.pad_token_id may not be its tokenizer's),
    through the scalar head -- rm.py's training and RewardModel's scoring alike. bf16: the run
    computes in bf16 (autocast where the weights are fp32: LoRA's base). shared_lens: (B,) how
    many first tokens each sequence has in common with another of the batch (a pair's prompt, and
    the start its two responses share): those then run once (logprobs.share_prompts), where the
    model is verified to allow it; without them, or where it is not, every sequence runs in its
    own padded row."""
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    if not hasattr(base, "score"):  # an encoder (DeBERTa): its classifier reads its own pooled
        batch = _right_padded(sequences, pad_id, device)  # state, the padding masked
        return model(**batch).logits[:, 0].float()
    decoder = getattr(base, base.base_model_prefix)
    B = len(sequences)
    lengths = torch.tensor([len(s) for s in sequences])  # (B,)
    # share_prompts hands back the state that *predicts* each completion token, never the last
    # token's own; so each sequence gets one dummy token (the pad) after it, and the state that
    # predicts the dummy is the last real token's. Causal attention: it changes no state before it.
    ids = right_pad([s + [pad_id] for s in sequences], pad_id)  # (B, L + 1)
    shared = None
    if shared_lens is not None:
        # (at least one token, so the first completion token has a state to predict it)
        prompt_lens = torch.tensor([min(max(n, 1), len(s))
                                    for n, s in zip(shared_lens, sequences)])  # (B,)
        shared = share_prompts(base, ids, prompt_lens, lengths + 1 - prompt_lens)
    with autocast(device, bf16 and next(model.parameters()).dtype == torch.float32):
        if shared is None:
            # Right padding needs no attention mask: causal attention never looks at the later pad,
            # positions 0..L-1 are already right, and SDPA keeps its fast causal kernel (a padding
            # mask makes transformers build an (L, L) mask per row). No KV cache to build.
            hidden = decoder(input_ids=ids[:, :-1].to(device),  # (the rows without the dummy)
                             use_cache=False).last_hidden_state  # (B, L, H)
            last = hidden[torch.arange(B, device=device), lengths.to(device) - 1]  # (B, H)
        else:  # each distinct prefix once, then each sequence's own rest and its dummy
            hidden = shared.hidden(decoder)
            # hidden: (R, L', H), each distinct prefix once, then the sequences' rests
            dummy = (lengths - prompt_lens).to(device)  # (B,) its index in the "completion"
            state = shared.state[torch.arange(B, device=device), dummy]  # (B,) predicts it
            last = hidden[shared.row, state]  # (B, H)
        return base.score(last).squeeze(-1).float()  # (B,)


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    return _text(messages)  # (a tokenizer without a chat template: the texts one after another)


def _text(messages: list[dict]) -> str:
    return "\n".join(str(m.get("content") or "") for m in messages)


def _right_padded(ids: list[list[int]], pad_id, device) -> dict:
    L = max(len(i) for i in ids)
    input_ids = torch.full((len(ids), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), L), dtype=torch.long)
    for k, row in enumerate(ids):
        input_ids[k, :len(row)], mask[k, :len(row)] = torch.tensor(row), 1
    return {"input_ids": input_ids.to(device), "attention_mask": mask.to(device)}


def frozen_models(reward_models: str, judges: str) -> tuple:
    """(name, folder or hub id, head) of every --reward-model and --judge: the frozen models a run
    keeps on its device beside the policy (gpu_memory.plan_memory counts them)."""
    specs = [(s, "--reward-model", "rm", "reward") for s, _ in weighted(reward_models, True)] + \
        [(s, "--judge", "judge", "lm") for s, _ in weighted(judges, True)]
    out = []
    for given, flag, kind, head in specs:
        out.append((f"{kind}:{Path(given).name or given}", resolve(given, flag), head))
    return tuple(out)


def _config(path: str, flag: str) -> dict:
    folder = Path(resolve(path, flag))
    if not (folder / "config.json").exists():  # (a hub id: resolve found it in the cache)
        from transformers import AutoConfig
        return AutoConfig.from_pretrained(str(folder), trust_remote_code=False).to_dict()
    return json.loads((folder / "config.json").read_text())
