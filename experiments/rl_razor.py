"""RL's Razor (Shenfeld et al. 2025, "RL's Razor: Why Online Reinforcement Learning Forgets Less").

The claim: taught the same new task to the same accuracy, RL forgets less of what the model knew
than supervised fine-tuning -- and what predicts the forgetting, whichever the algorithm, is how
far the model moved on the new task's own prompts: the forward KL, KL(pi_0 || pi), there.

    python experiments/rl_razor.py               # 3 seeds of GRPO and of SFT at matched accuracy
    python experiments/rl_razor.py --tiny

The new task is arith. GRPO: 12 steps at --lr 2e-5 (lenient_verifier.py's lenient arm, whose runs
serve here). SFT: sft.py on 256 stream problems answered in the template's sentence ("The answer is
N."), --lr 2e-5, evaluated greedily on the 128 held-out problems after every step; for each seed,
the step whose held-out accuracy is nearest that GRPO seed's is run again to that step, and its
model is the one compared (matched accuracy; both accuracies recorded). Forgetting: the increase
of the negative log-likelihood per token, over the starting model's, of a fixed held-out chat set
-- 32 everyday requests and a reply to each, written below (not taken from a hub; not the model's
own greedy replies, as the first design took: any model sharper than the start finds its own mode
likelier, and that read as negative forgetting in every run). Forward KL: the mean per token of
log pi_0(y) - log pi(y) over 4 samples of the starting model at T = 1.0 on each of 32 held-out
arith prompts. Cost: the GRPO runs
shared (~10 min without them), 3 SFT runs with 16 evaluations (~3 min each) and their reruns,
~15 min on a 2-core CPU.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arguments, by_seed, held_out, mean_spread, metric, pearson  # noqa: E402
from common import run_arms, run_once, start_model, term, tiny_model, write_finding  # noqa: E402

GRPO = ["--data", "arith", "--lr", "2e-5", "--eval-every", "0", "--reward", "correctness"]
SFT = ["--eval-data", "arith", "--eval-size", "128", "--lr", "2e-5", "--batch-size", "16"]
TINY_SFT = ["--eval-size", "4", "--batch-size", "2", "--max-new-tokens", "6"]
SFT_STEPS, SFT_ROWS = 16, 256
CHAT = [  # the held-out chat set: everyday requests, nothing of arithmetic, each with a reply
    # written here (not the model's own, not taken from a hub): its NLL under a model is what
    # the model still knows of plain chat -- text a sharper model does not find likelier for free
    ("Give me three tips for sleeping better.", "Go to bed at the same time each night, keep "
     "the room dark and cool, and put your phone away an hour before sleep."),
    ("What is a good name for a grey cat?", "Smokey, Ash or Pebble would all suit a grey cat."),
    ("Write a short thank-you note to a neighbour.", "Dear neighbour, thank you for watering my "
     "plants while I was away. They look wonderful, and so does your garden."),
    ("How do I boil an egg?", "Put the egg in boiling water for about eight minutes, then cool "
     "it in cold water before you peel it."),
    ("Describe autumn in two sentences.", "The leaves turn red and gold and fall in the wind. "
     "The days grow shorter and the air smells of rain."),
    ("What should I pack for a day at the beach?", "Bring sun cream, a hat, a towel, water and "
     "something to eat."),
    ("Suggest a title for a story about a lost key.", "The Key Under the Stairs."),
    ("Why is the sky blue?", "Air scatters blue light from the sun more than red light, so blue "
     "reaches our eyes from every part of the sky."),
    ("How can I keep basil alive indoors?", "Give it a sunny window, water it when the soil "
     "feels dry, and pinch off the flowers so it keeps making leaves."),
    ("Write a haiku about rain.", "Soft rain on the roof / the garden drinks in silence / "
     "puddles hold the sky"),
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Give me a tip for learning a new language.", "Practise a little every day, and speak it "
     "out loud, even if you make mistakes."),
    ("How do I politely decline an invitation?", "Thank them for asking, say you cannot come "
     "this time, and wish them a good evening."),
    ("Name three fruits that are red.", "Strawberries, cherries and raspberries."),
    ("What is a healthy breakfast?", "Porridge with fruit, or eggs with wholemeal toast, and a "
     "glass of water."),
    ("Explain what a library is to a child.", "A library is a building full of books that you "
     "can borrow for free and bring back when you have read them."),
    ("Write one sentence encouraging a friend before an exam.", "You have worked hard for this, "
     "so take a deep breath and show them what you know."),
    ("What makes a good password?", "A long one that is hard to guess, such as several random "
     "words together, and different for every account."),
    ("How do bees make honey?", "Bees collect nectar from flowers, store it in the hive and fan "
     "it with their wings until most of the water dries off."),
    ("Suggest a weekend activity for a rainy day.", "Bake some bread, play a board game or "
     "visit a museum."),
    ("What is the difference between a lake and a sea?", "A lake is surrounded by land and "
     "usually holds fresh water, while a sea is salty and joined to the ocean."),
    ("How do I clean a wooden table?", "Wipe it with a soft cloth and a little soapy water, then "
     "dry it straight away."),
    ("Write a two-line poem about the moon.", "The moon looks down on the sleeping town, / and "
     "lays on every roof a silver gown."),
    ("What should I do if I feel tired at work?", "Stand up and walk for a few minutes, drink "
     "some water and step outside for fresh air if you can."),
    ("Give me an idea for a birthday gift for my mother.", "A photo book of family pictures, "
     "with a short note from you on the first page."),
    ("How does a bicycle stay upright?", "When it moves, the rider steers into any lean, and the "
     "shape of the front fork helps the wheel turn the right way."),
    ("What are clouds made of?", "Clouds are made of tiny drops of water or bits of ice "
     "floating in the air."),
    ("Recommend a way to start journaling.", "Write three lines each evening about what happened "
     "and how you felt."),
    ("Describe a sunrise to someone who has never seen one.", "The dark sky slowly turns pink and "
     "orange at one edge, and then a bright light climbs up and warms your face."),
    ("How do I make tea?", "Pour boiling water over a tea bag, wait three minutes, then take the "
     "bag out and add milk if you like."),
    ("What is a polite way to ask for help?", "Excuse me, could you help me with something when "
     "you have a moment?"),
    ("Write a sentence about the sea.", "The sea rolled in grey and slow, and the gulls cried "
     "over the waves."),
]
MINUTES = 15
TITLE = "RL's Razor"  # (its heading in docs/findings.md)


def main():
    args = arguments(__doc__, seeds=3, steps=12)
    grpo = run_arms("rl_razor", {"GRPO": GRPO}, args)["GRPO"]  # (lenient_verifier's lenient arm)
    targets = [held_out(str(f / "model"), args.tiny) for f in grpo.values()]
    sft, curves = zip(*(matched_sft(args, seed, target) for seed, target in
                        zip(grpo, targets)))
    sft_accuracy = [held_out(str(f / "model"), args.tiny) for f in sft]
    probe = Probe(args)
    measured = {arm: [probe.measure(str(f / "model")) for f in folders]
                for arm, folders in (("GRPO", grpo.values()), ("SFT", sft))}
    kl, forgetting = ({arm: [m[i] for m in ms] for arm, ms in measured.items()} for i in (0, 1))
    points = {arm: [[(k, f)] for k, f in zip(kl[arm], forgetting[arm])] for arm in kl}
    everything = [(k, f) for arm in kl for k, f in zip(kl[arm], forgetting[arm])]
    frontier = "forgetting (chat NLL increase) against forward KL on arith"
    write_finding("rl_razor", {frontier: points,
                               f"held-out accuracy: SFT by step, GRPO's after its {args.steps} "
                               "(the target)": {"GRPO": [[(0, t), (len(c) - 1, t)] for t, c in
                                                         zip(targets, curves)],
                                                "SFT": list(curves)}},
                  args,
                  axes_of={frontier: "KL(pi_0 || pi) on arith prompts (per token)"},
                  claim="at matched accuracy RL forgets less than SFT; forward KL predicts it",
                  paper="Shenfeld et al. 2025, RL's Razor",
                  matched={"grpo_accuracy": targets, "sft_accuracy": sft_accuracy},
                  measured={arm: {"forgetting": mean_spread(forgetting[arm]),
                                  "forward_kl": mean_spread(kl[arm])} for arm in kl},
                  kl_forgetting_correlation=pearson(*zip(*everything)) if everything else None,
                  title=TITLE, estimated_minutes=MINUTES,
                  terms={"RL forgets less": term(by_seed(forgetting["SFT"], forgetting["GRPO"]),
                                                 "positive", "chat NLL increase, SFT minus GRPO "
                                                 "at matched accuracy (nats a token)"),
                         "accuracy matched": term(by_seed(sft_accuracy, targets), "none",
                                                  "held-out accuracy, SFT minus GRPO (the match)",
                                                  margin=0.05)})


def matched_sft(args, seed: int, target: float) -> tuple[Path, list]:
    """sft.py run for SFT_STEPS with a held-out evaluation every step, then again to the step whose
    accuracy is nearest `target`: that run's folder, and the first run's accuracy by step."""
    data = sft_data(args)
    name = f"{'tiny-' if args.tiny else ''}rl_razor"
    tiny = ["--model", tiny_model(args.runs), *TINY_SFT] if args.tiny else []
    steps = 2 if args.tiny else SFT_STEPS
    line = lambda n, every, out: [  # noqa: E731
        "--data", str(data), *SFT, "--steps", str(n), "--eval-every", str(every), "--seed",
        str(seed), "--out", str(args.runs / name / out), *tiny]
    curve = metric(run_once(f"rl_razor: SFT, seed {seed}", "sft", line(steps, 1, f"sft-s{seed}"),
                            args), "eval_accuracy")
    best = min((s for s in curve if s[0] > 0), key=lambda s: abs(s[1] - target))[0]
    return run_once(f"rl_razor: SFT to step {best}, seed {seed}", "sft",
                    line(best, 0, f"sft-s{seed}-to{best}"), args), curve


def sft_data(args) -> Path:
    """The stream's first problems, each answered in the template's sentence, as chat rows."""
    from data import TEMPLATES, arith_stream
    path = args.runs / f"{'tiny-' if args.tiny else ''}rl_razor-sft.jsonl"
    stream = arith_stream(0)
    rows = [next(stream) for _ in range(8 if args.tiny else SFT_ROWS)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": TEMPLATES["answer-is"][0].format(problem=r["problem"])},
        {"role": "assistant", "content": f"The answer is {r['answer']}."}]}) + "\n"
        for r in rows))
    return path


class Probe:
    """The chat set (its written replies after the chat template's prompt) and the starting
    model's samples on arith prompts (T = 1.0), and the starting model's log-probs of both: what
    forgetting and the forward KL are read against."""

    def __init__(self, args):
        import torch
        from data import arith_heldout, encode_prompts
        from model import load_model
        from rollout import HFRollout
        from sampling import Completions, Sampling
        self.start = start_model(args)
        model, self.tokenizer = load_model(self.start, "cpu", torch.float32)
        engine = HFRollout(model, self.tokenizer, dtype=torch.float32, shares_weights=True)
        pairs = CHAT[:4 if args.tiny else None]
        tokens = 6 if args.tiny else 48
        prompts = encode_prompts(self.tokenizer, [{"prompt": [{"role": "user", "content": q}]}
                                                  for q, _ in pairs], "answer-is")
        # Each reply as the model would end it: its text, then the end-of-turn token.
        replies = [(self.tokenizer(r, add_special_tokens=False)["input_ids"] +
                    [self.tokenizer.eos_token_id])[:tokens] for _, r in pairs]
        self.chat = Completions(prompts, replies, [False] * len(pairs), [r for _, r in pairs])
        task = encode_prompts(self.tokenizer, arith_heldout(4 if args.tiny else 32), "answer-is")
        self.task = engine.generate(task, 2 if args.tiny else 4,
                                    Sampling(tokens // 2, 1.0, seed=0))
        self.chat_lp, self.task_lp = self.logprobs(model, self.chat), self.logprobs(model,
                                                                                    self.task)

    def measure(self, model: str) -> tuple[float, float]:
        """A model's (forward KL per token on the arith samples, forgetting: its chat NLL per
        token less the starting model's)."""
        import torch
        from model import load_model
        policy = load_model(model, "cpu", torch.float32)[0]
        (chat, mask), (task, task_mask) = self.logprobs(policy, self.chat), \
            self.logprobs(policy, self.task)
        kl = ((self.task_lp[0] - task) * task_mask).sum() / task_mask.sum()
        forgetting = ((self.chat_lp[0] - chat) * mask).sum() / mask.sum()
        return float(kl), float(forgetting)

    def logprobs(self, model, comps):
        import torch
        from logprobs import completion_logprobs, length_mask, pack
        batch = pack(comps.prompt_ids, comps.completion_ids, self.tokenizer.pad_token_id)
        with torch.no_grad():
            lp, _ = completion_logprobs(model, batch.input_ids, batch.prompt_lens,
                                        batch.completion_lens)
        return lp, length_mask(batch.completion_lens, lp.shape[1])


if __name__ == "__main__":
    main()
