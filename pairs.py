"""Preference pairs as tokens, for dpo.py and rm.py: from rows in TRL's preference format (checked
by formats.check_pairs) or sampled from the model itself on the arith task (`builtin_pairs`: the
model's own right answer, else the reference answer, preferred to its own wrong one).

A Pair is (prompt, chosen, rejected) token ids, each response as it follows the prompt in the chat
format: what DPO scores token by token. A reward model reads each conversation whole, as text
through its chat template (rm.reward_pairs): a builtin pair carries its texts for it (`row`).
"""

from dataclasses import dataclass

from data import TEMPLATES, InputError, arith_stream, encode_prompts
from reward import Grader, extract_answer
from sampling import Sampling


ANSWER_TOKENS = 32  # an arith answer's tokens at most (the builtin pairs, dpo.py's held-out task)


@dataclass
class Pair:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    margin: float = 0.0  # how much more the chosen must score (TRL's margin column; rm.py)
    row: dict | None = None  # a builtin pair as a row of TRL's preference format, its responses
    # as decoded text: what a reward model renders of it, as it renders a policy's completion


def _chat_ids(tokenizer, messages, add_generation_prompt=False) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True,
                                        add_generation_prompt=add_generation_prompt)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _text_response(tokenizer, text: str) -> list[int]:
    """A plain-string response, closed with the end-of-turn token the model must learn to emit."""
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def _response_ids(tokenizer, prompt, prompt_ids, response) -> list[int]:
    """Token ids of `response` (a string or assistant messages) as it follows the prompt."""
    if isinstance(response, list) and isinstance(prompt, list):
        # Render the whole conversation and take what follows the prompt, up to end-of-turn.
        full = _chat_ids(tokenizer, prompt + response)
        if full[:len(prompt_ids)] == prompt_ids:
            tail = full[len(prompt_ids):]
            if tokenizer.eos_token_id in tail:
                tail = tail[:tail.index(tokenizer.eos_token_id) + 1]
            return tail
    if isinstance(response, list):
        response = "".join(m.get("content", "") for m in response if isinstance(m, dict))
    return _text_response(tokenizer, response)


def tokenize_pairs(tokenizer, rows, source, cfg):
    """Pairs of token ids from check_pairs' rows. Over-long pairs lose prompt tokens (from the
    left) down to max_prompt_length, then response tokens; a pair whose prompt alone is too long
    is skipped and counted."""
    pairs, skipped = [], 0
    for row in rows:
        prompt = row["prompt"]
        if isinstance(prompt, list):
            prompt_ids = _chat_ids(tokenizer, prompt, add_generation_prompt=True)
        elif not prompt:  # (an implicit prompt of plain strings: none; rm.py)
            prompt_ids = []
        elif cfg.chat and tokenizer.chat_template:
            prompt_ids = _chat_ids(tokenizer, [{"role": "user", "content": prompt}], True)
        else:
            prompt_ids = tokenizer(prompt)["input_ids"]
        if len(prompt_ids) >= cfg.max_length:
            skipped += 1
            continue
        chosen = _response_ids(tokenizer, prompt, prompt_ids, row["chosen"])
        rejected = _response_ids(tokenizer, prompt, prompt_ids, row["rejected"])
        if len(prompt_ids) + max(len(chosen), len(rejected)) > cfg.max_length:
            prompt_ids = prompt_ids[-cfg.max_prompt_length:]
            room = cfg.max_length - len(prompt_ids)
            chosen, rejected = chosen[:room], rejected[:room]
        pairs.append(Pair(prompt_ids, chosen, rejected, row.get("margin", 0.0)))
    if skipped:
        print(f"{source}: skipped {skipped} of {len(rows)} pairs whose prompt alone is longer "
              f"than --max-length {cfg.max_length}")
    if not pairs:
        raise InputError(f"{source}: no usable pairs (all {skipped} prompts exceed --max-length)")
    return pairs, skipped


def corrected(text: str, wrong: str | None, answer: str) -> str | None:
    """`text` with its answer `wrong` (extract_answer's, the last occurrence) replaced by the right
    `answer`: the same words, the same format, only the number changed. None without an answer."""
    if not wrong or wrong not in text:
        return None
    head, _, tail = text.rpartition(wrong)
    return head + answer + tail


def builtin_pairs(rollout, tokenizer, cfg, correct_own: bool = False):
    """On-policy pairs from the arith task: the model's own wrong answer is rejected; its own right
    answer is chosen when it has one, else the reference answer in the template's format -- or,
    with correct_own, that wrong answer with its number corrected (then the two differ in the
    number alone, and a reward model cannot tell them apart by their form: rm.py)."""
    stream = arith_stream(cfg.seed + 1)
    problems = [next(stream) for _ in range(cfg.builtin_problems)]
    prompt_ids = encode_prompts(tokenizer, problems, cfg.template, cfg.chat)
    n = cfg.builtin_samples
    comps = rollout.generate(prompt_ids, n, Sampling(ANSWER_TOKENS, temperature=0.7, seed=cfg.seed))
    fmt = TEMPLATES[cfg.template][1]
    grader = Grader()
    answers = [extract_answer(t, fmt) for t in comps.text]
    correct = grader.grade(answers,
                           [p["answer"] for p in problems for _ in range(n)])
    grader.close()
    pairs, own_chosen, own_fixed = [], 0, 0
    for i, problem in enumerate(problems):
        group = range(i * n, (i + 1) * n)
        right = [k for k in group if correct[k] and not comps.truncated[k]]
        wrong = [k for k in group if not correct[k]]
        if not wrong:
            continue  # nothing to prefer against
        fixed = corrected(comps.text[wrong[0]], answers[wrong[0]], problem["answer"]) \
            if correct_own and not comps.truncated[wrong[0]] else None
        asked = [{"role": "user", "content": TEMPLATES[cfg.template][0].format(
            problem=problem["problem"])}]
        rejected = comps.text[wrong[0]]
        if right:
            chosen = comps.completion_ids[right[0]]
            text = comps.text[right[0]]
            own_chosen += 1
        elif fixed is not None:  # (both as text: they differ in the number's tokens only)
            pairs.append(Pair(prompt_ids[i], _text_response(tokenizer, fixed),
                              _text_response(tokenizer, rejected),
                              row={"prompt": asked, "chosen": fixed, "rejected": rejected}))
            own_fixed += 1
            continue
        else:
            text = (f"The answer is {problem['answer']}." if fmt == "answer-is"
                    else f"\\boxed{{{problem['answer']}}}")
            chosen = _text_response(tokenizer, text)
        pairs.append(Pair(prompt_ids[i], chosen, comps.completion_ids[wrong[0]],
                          row={"prompt": asked, "chosen": text, "rejected": rejected}))
    print(f"builtin pairs: {len(pairs)} from {len(problems)} problems x {n} samples; chosen is the "
          f"model's own answer in {own_chosen}, its wrong one corrected in {own_fixed}, the "
          f"reference answer in {len(pairs) - own_chosen - own_fixed}")
    return pairs
