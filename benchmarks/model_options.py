"""The model a benchmark measures, as its command line names it: --model, and --dtype resolved as a
run resolves it -- on the device there is, bf16 or fp32 (auto: bf16 where it computes natively).

    parser = model_parser(__doc__)                 # --model, --dtype; the benchmark adds its own
    args = parser.parse_args()
    device, dtype = measured_on(args)             # "cuda" or "cpu", a hardware.DtypeChoice

activations.py and decode_floor.py take them.
"""

import argparse


def model_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's command line (its description: the docstring's first line) with --model and
    --dtype."""
    from model import DEFAULT_MODEL
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="the offline default, a hub id, or a local HF folder")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                        help="the compute dtype (auto: what a run would pick here)")
    return parser


def measured_on(args) -> tuple:
    """(the device, the dtype choice) the model runs on and in, as a run picks them."""
    from hardware import choose_dtype, pick_device
    device = pick_device()
    return device, choose_dtype(args.dtype, device)
