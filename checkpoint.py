"""Checkpoints of a GRPO run: the one place their format is written and read.

    <out>/checkpoints/step_N/
        config.json, model.safetensors, tokenizer files   the policy as an HF folder, loadable as is
                                                          (LoRA: adapter_config.json and
                                                          adapter_model.safetensors instead)
        trainer_state.pt   optimizer, LR schedule, torch RNG          (written by trainer rank 0)
        driver_state.pt    step, data position, python + numpy RNG    (written by the driver)
        metrics.jsonl, grpo_config.json (or dpo_config.json)          the run so far

A checkpoint is written to `.tmp-step_N` and renamed into place, so a kill -9 during a save leaves
the previous one whole. Checkpoints carry their run's id: a run only ever prunes its own, and never
the one it resumed from. Resuming from an earlier step than the run's newest checkpoint starts a new
branch of it: the later checkpoints are moved, whole, to checkpoints/superseded/ (said on the first
screen; `--resume auto` then picks the newest of the branch being run, and nothing is deleted). Training state is read with `weights_only=True`: tensors and plain
containers only, so a checkpoint someone shares can never run code on --resume (transformers'
Trainer had to learn this: CVE-2026-1839). A damaged file stops the run with one line naming it.
"""

import json
import os
import random
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from data import escaped
from model import full_optimizer_state, full_state_dict, is_lora, load_optimizer_state
from model import save_model
from rollout_log import DamagedLog, json_lines


def save_trainer_state(folder, model, tokenizer, optimizer, scheduler, writer: bool = True):
    """The trainer's half: model, optimizer, schedule, RNG. Every rank calls it (a sharded model's
    full tensors are gathered from all of them); only the `writer` (rank 0) writes."""
    weights = None if is_lora(model) else full_state_dict(model)  # LoRA: the adapters alone
    optimizer_state = full_optimizer_state(model, optimizer)
    if writer:
        save_model(model, tokenizer, folder, weights)
        torch.save({"optimizer": optimizer_state, "scheduler": scheduler.state_dict(),
                    "torch_rng": torch.get_rng_state()}, Path(folder) / "trainer_state.pt")


def load_trainer_state(folder, model, optimizer, scheduler):
    """Restore what save_trainer_state wrote (the model itself is loaded from the folder)."""
    state = load_state(Path(folder) / "trainer_state.pt")
    load_optimizer_state(model, optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])


@dataclass
class DriverState:
    """Where the driver's loop stands: what a resumed run starts from."""
    step: int = 0  # the last step done
    consumed: int = 0  # training problems drawn from the data stream so far
    history: list[dict] = field(default_factory=list)  # metrics.jsonl so far
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # whose checkpoints are whose
    resumed_from: str = ""  # the checkpoint this process started from: never pruned (not saved)


def save_checkpoint(out: Path, driver: DriverState, save_trainer, keep_last: int):
    """<out>/checkpoints/step_N, atomically; then prune to the newest keep_last (0 keeps all)."""
    folder = out / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".tmp-step_{driver.step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_trainer(str(tmp))
    kind, keys, pos, has_gauss, gauss = np.random.get_state()  # as lists: loadable weights-only
    torch.save({"step": driver.step, "consumed": driver.consumed, "python_rng": random.getstate(),
                "numpy_rng": [kind, keys.tolist(), pos, has_gauss, gauss],
                "run_id": driver.run_id}, tmp / "driver_state.pt")
    for name in ["metrics.jsonl", *(p.name for p in out.glob("*_config.json"))]:
        shutil.copy(out / name, tmp / name)  # the run so far, and its config (grpo's or dpo's)
    final = folder / f"step_{driver.step}"
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)  # atomic: the checkpoint exists whole, or not at all
    if keep_last:  # this run's own checkpoints only, and never the one it resumed from
        ours = [p for p in _checkpoints(folder) if _run_of(p) == driver.run_id]
        for old in sorted(ours, key=_step_of)[:-keep_last]:
            if driver.resumed_from and old.resolve() == Path(driver.resumed_from).resolve():
                continue
            shutil.rmtree(old)


def load_driver_state(folder) -> DriverState:
    """The driver's half, with the python and numpy RNGs restored."""
    state = load_state(Path(folder) / "driver_state.pt")
    random.setstate(state["python_rng"])
    kind, keys, *rest = state["numpy_rng"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    history = saved_history(folder)
    # (a checkpoint from before run ids: the resumed run takes a new one)
    return DriverState(state["step"], state["consumed"], history,
                       state.get("run_id") or uuid.uuid4().hex, resumed_from=str(folder))


def saved_history(folder) -> list[dict]:
    """A checkpoint's metrics.jsonl, the run's records so far; damage stops the run in one line
    that names the file and the line (a checkpoint may be someone else's)."""
    path = Path(folder) / "metrics.jsonl"
    try:
        return [r for _, _, r in json_lines(path, said=lambda _: None)]
    except (DamagedLog, OSError) as e:
        why = e if isinstance(e, DamagedLog) else f"{path}: {e.strerror}"
        raise SystemExit(f"error: checkpoint {folder}: {why}; resume from another checkpoint "
                         f"with --resume PATH") from None


def claim_checkpoints(out: Path, resume_dir: str = "") -> str:
    """Before anything is written: every checkpoint in <out>/checkpoints must belong to the run
    being started or resumed, or pruning (--keep-last), saving and --resume auto would mix two runs.
    A fresh run (no resume_dir) stops at any checkpoint there; a resumed run at any of another run
    id -- a resume into another --out is refused exactly as a fresh run is. The resumed run's own
    checkpoints at later steps than resume_dir belong to the branch it leaves: they are moved to
    checkpoints/superseded/<time>/ (kept whole; the returned line says so; "" when none moved)."""
    found = sorted(_checkpoints(out / "checkpoints"), key=_step_of)
    run = _run_of(Path(resume_dir)) if resume_dir else None
    foreign = [p for p in found if not resume_dir or _run_of(p) != run]
    if foreign:
        names = ", ".join(p.name for p in foreign)
        how = "continue that run with --resume auto" if not resume_dir else \
            f"resume {resume_dir} into an --out of its own"
        raise SystemExit(escaped(f"error: {out / 'checkpoints'} holds another run's checkpoints "
                                 f"({names}): {how}, or choose another --out (nothing was "
                                 f"changed)"))
    later = [p for p in found if resume_dir and _step_of(p) > _step_of(Path(resume_dir))
             and p.resolve() != Path(resume_dir).resolve()]
    if not later:
        return ""
    aside = move_aside(later, out / "checkpoints" / "superseded")
    return escaped(f"resuming from {Path(resume_dir).name}: this run's later checkpoints "
                   f"({', '.join(p.name for p in later)}) are another branch of it now, moved "
                   f"whole to {aside} (--resume auto will not pick them; --resume "
                   f"{aside}/{later[-1].name} would)")


def move_aside(paths: list[Path], superseded: Path) -> Path:
    """paths moved whole (renamed: nothing copied, nothing deleted) into a new folder of
    `superseded` named for the time; that folder."""
    aside = superseded / time.strftime("%Y%m%d-%H%M%S")
    while aside.exists():
        aside = aside.with_name(aside.name + "+")
    aside.mkdir(parents=True)
    for p in paths:
        os.replace(p, aside / p.name)
    return aside


def recorded_dtype(out, resume: str, config_file: str) -> str:
    """The dtype the run being resumed computed in, as its checkpoint's config recorded it ("" for
    a fresh run, or a checkpoint without one): a resumed run keeps it instead of timing again."""
    if not resume:
        return ""
    folder = Path(resume) if resume != "auto" else max(_checkpoints(Path(out) / "checkpoints"),
                                                       key=_step_of, default=None)
    try:
        return str(json.loads((folder / config_file).read_text()).get("dtype", ""))
    except (OSError, ValueError, TypeError, AttributeError):  # find_checkpoint names the problem
        return ""


def find_checkpoint(out: Path, resume: str) -> str:
    """--resume auto: the newest complete checkpoint in <out>/checkpoints; or the folder given.
    Its files are checked here, before any model loads, so a damaged one is named at once."""
    if resume != "auto":
        if not (Path(resume) / "driver_state.pt").exists():
            raise SystemExit(f"error: --resume {resume}: not a checkpoint folder (no driver_state.pt)")
        folder = Path(resume)
    else:
        found = _checkpoints(out / "checkpoints")
        if not found:
            raise SystemExit(f"error: --resume auto: no checkpoint in {out / 'checkpoints'}")
        folder = max(found, key=_step_of)
    for name in ("driver_state.pt", "trainer_state.pt"):
        load_state(folder / name, mmap=True)  # reads the structure, not gigabytes of tensors
    saved_history(folder)
    from safetensors import safe_open
    for weights in folder.glob("*.safetensors"):
        try:
            with safe_open(weights, "pt") as f:
                f.keys()
        except Exception as e:
            # (escaped: safetensors quotes the header, and a checkpoint may be someone else's)
            raise SystemExit(escaped(f"error: checkpoint {folder}: {weights.name} is damaged "
                                     f"({e}); resume from another checkpoint with --resume "
                                     f"PATH")) from None
    return str(folder)


def load_state(path, mmap: bool = False) -> dict:
    """A training-state file, weights-only; a damaged or foreign one stops the run with one line
    that names it and says what to do."""
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:
        others = sorted(p.name for p in path.parent.parent.glob("step_*") if p != path.parent)
        hint = f" (others there: {', '.join(others)})" if others else ""
        raise SystemExit(escaped(f"error: checkpoint {path.parent}: {path.name} cannot be "
                                 f"loaded safely ({type(e).__name__}): it is damaged, or holds "
                                 f"more than tensors and plain data, which smolrl never "
                                 f"unpickles. Resume from another checkpoint with --resume "
                                 f"PATH{hint}.")) from None


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def _run_of(checkpoint: Path) -> str | None:
    return load_state(checkpoint / "driver_state.pt").get("run_id")


def _checkpoints(folder: Path) -> list[Path]:
    return [p for p in folder.glob("step_*") if (p / "driver_state.pt").exists()]
