"""One training example (Wang et al. 2025, "Reinforcement Learning for Reasoning in Large Language
Models with One Training Example", 1-shot RLVR).

The claim: RL on a single problem, sampled again and again, raises held-out accuracy about as much
as RL on the whole training set (MATH500 36 -> 74 % for Qwen2.5-Math-1.5B from one example).

    python experiments/one_example.py            # 2 arms x 3 seeds x 12 steps, the default model
    python experiments/one_example.py --tiny

Arms: the arith stream (a fresh problem every prompt) against one arith problem, the same 4
prompts of it each step (4 x 8 samples, as the stream's 4 a step). The example is picked as the paper picks it, by the
spread of its accuracy: of the stream's first 32 problems, sampled 8 times each at T = 0.7 by the
starting model, the one whose share right is nearest one half (an example always right, or always
wrong, gives no gradient). Measured: greedy accuracy on the 128 held-out arith problems at the start
and the end (graded after the runs: the stream's arm is lenient_verifier.py's lenient arm, run
once for both), and the training accuracy.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arguments, by_seed, correct_counts, mean_spread, run_arms  # noqa: E402
from common import held_out_gains, tiny_model, write_finding  # noqa: E402

def pick_example(args) -> dict:
    """The stream's problem whose share right, in 8 samples at T = 0.7 by the starting model, is
    nearest one half (of its first 32; --tiny: of 4)."""
    from data import arith_stream
    from model import DEFAULT_MODEL
    stream = arith_stream(0)
    rows = [next(stream) for _ in range(4 if args.tiny else 32)]
    model = tiny_model(args.runs) if args.tiny else DEFAULT_MODEL
    counts = correct_counts(model, rows, 8, 0.7)
    best = min(range(len(rows)), key=lambda i: abs(counts[i] - 4))
    print(f"one_example: {rows[best]['problem']} ({counts[best]} of 8 right at the start; "
          f"share right of the first {len(rows)}: {counts})")
    return {"problem": rows[best]["problem"], "answer": rows[best]["answer"],
            "right_of_8": counts[best]}


def main():
    args = arguments(__doc__, seeds=3, steps=12)
    example = pick_example(args)
    one = args.runs / f"{'tiny-' if args.tiny else ''}one_example.jsonl"
    one.parent.mkdir(parents=True, exist_ok=True)
    one.write_text(json.dumps({k: example[k] for k in ("problem", "answer")}) + "\n")
    # (the stream's arm is lenient_verifier.py's lenient arm: its runs serve here too)
    arms = {"the arith stream": ["--data", "arith"],
            "one example": ["--data", str(one), "--task", "arith"]}
    runs = run_arms("one_example", arms, args,
                    common=["--lr", "2e-5", "--eval-every", "0", "--reward", "correctness"])
    panels, gains = held_out_gains(runs, args, "held-out accuracy (greedy, 128 problems; start and end)")
    gain = {arm: mean_spread(g) for arm, g in gains.items()}
    write_finding("one_example", panels, args,
                  claim="RL on one example raises held-out accuracy about as much as on all",
                  paper="Wang et al. 2025, 1-shot RLVR", example=example,
                  measured={arm: {"held_out_gain": m, "spread": s} for arm, (m, s) in
                            gain.items()},
                  effect_by_seed=by_seed(gains["one example"], gains["the arith stream"]),
                  effect_name="held-out gain, one example minus the stream (points of 1)")


if __name__ == "__main__":
    main()
