"""Checkpoints of a run: the one place their format is written and read, and the rules that keep
one run's checkpoints apart from another's and one branch's from another's.

    <out>/checkpoints/step_N/
        config.json, model.safetensors, tokenizer files   the policy as an HF folder, loadable as is
                                                          (LoRA: adapter_config.json and
                                                          adapter_model.safetensors instead)
        trainer_state.pt   optimizer, LR schedule, torch RNG          (written by trainer rank 0)
        driver_state.pt    step, data position, python + numpy RNG    (written by the driver)
        metrics.jsonl, grpo_config.json (or dpo_config.json)          the run so far

A checkpoint is written to `.tmp-step_N` and renamed into place, so a kill -9 during a save leaves
the previous one whole; a write that fails (a full disk, a file-size limit) deletes what it wrote
and raises OSError, whoever wrote it (session.write_checkpoint says so in one line). Training
state is read with `weights_only=True`: tensors and plain containers only, so a checkpoint someone
shares can never run code on --resume (transformers' Trainer had to learn this: CVE-2026-1839).
Every file is checked when the checkpoint is found, before any model loads: a damaged one stops
the run with one line naming it.

Runs and branches. Checkpoints carry their run's id: a run only ever prunes its own, and never the
one it resumed from. One branch of a run lives in --out at a time -- <out>/checkpoints and the
run's files beside it (metrics.jsonl, rollouts.jsonl, model/, ...); every other one lies whole in
a folder of <out>/superseded/ laid out as a run folder (its own checkpoints/, metrics, samples,
model). Resuming from one of <out>/checkpoints at an earlier step than the run got to (a later
checkpoint, or a final model past it) starts a new branch: the one it leaves -- its later
checkpoints, its metrics, samples, report and model -- is moved there whole (session.start_log
does it, at the run's first write: run_folder.py; claim_checkpoints names the checkpoints).
Resuming from a checkpoint anywhere else (a superseded branch, another folder) moves the branch
in --out aside whole likewise, its checkpoints with it; the resumed run takes the metrics in its
checkpoint and the samples of the run folder it lies in, up to its step. So pruning (--keep-last)
and `--resume auto`, which see <out>/checkpoints only, only ever see the branch being run; the
others stay as long as superseded/ keeps them (--keep-superseded).
"""

import errno
import json
import os
import random
import re
import shutil
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from data import escaped
from model import full_optimizer_state, full_state_dict, is_lora, load_optimizer_state
from model import lora_target_names, save_model
from rollout_log import DamagedLog, json_lines


def save_trainer_state(folder, model, tokenizer, optimizer, scheduler, writer: bool = True):
    """The trainer's half: model, optimizer, schedule, RNG. Every rank calls it (a sharded model's
    full tensors are gathered from all of them); only the `writer` (rank 0) writes."""
    weights = None if is_lora(model) else full_state_dict(model)  # LoRA: the adapters alone
    optimizer_state = full_optimizer_state(model, optimizer)
    if writer:
        with written():
            save_model(model, tokenizer, folder, weights)
            torch.save({"optimizer": optimizer_state, "scheduler": scheduler.state_dict(),
                        "torch_rng": torch.get_rng_state()}, Path(folder) / "trainer_state.pt")


@contextmanager
def written():
    """A write that fails -- a full disk, a file-size limit -- as the OSError it is. torch.save
    raises RuntimeError then ("[enforce fail at inline_container.cc] unexpected pos ..."), the
    safetensors writer SafetensorError ("I/O error: File too large (os error 27)"): as OSError it
    reaches the driver through Ray too (distributed._get), and save_checkpoint's caller names it
    in one line. Any other error is left as it is: a bug keeps its traceback."""
    from safetensors import SafetensorError
    try:
        yield
    except (RuntimeError, SafetensorError) as e:
        said = str(e)
        if not isinstance(e, SafetensorError) and not re.search(
                r"inline_container|PytorchStreamWriter|file write failed", said):
            raise
        code = re.search(r"os error (\d+)", said)
        said = re.sub(r"\[enforce fail at [^\]]*\][\s.]*", "", said).splitlines()[0]
        writer = "torch.save could not write" if isinstance(e, RuntimeError) else "safetensors"
        raise OSError(int(code[1]) if code else errno.EIO, f"{writer}: {said}") from e


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
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_trainer(str(tmp))
        kind, keys, pos, has_gauss, gauss = np.random.get_state()  # as lists: weights-only
        with written():
            torch.save({"step": driver.step, "consumed": driver.consumed,
                        "python_rng": random.getstate(),
                        "numpy_rng": [kind, keys.tolist(), pos, has_gauss, gauss],
                        "run_id": driver.run_id}, tmp / "driver_state.pt")
        for name in ["metrics.jsonl", *(p.name for p in out.glob("*_config.json"))]:
            shutil.copy(out / name, tmp / name)  # the run so far, and its config (grpo's, ...)
    except BaseException:  # (a full disk, an exit: nothing half-written stays, its room freed)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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
    """The driver's half, with the python and numpy RNGs restored (checked by find_checkpoint)."""
    state, history = read_driver_state(folder)
    random.setstate(state["python_rng"])
    np.random.set_state(_numpy_state(state["numpy_rng"]))
    # (a checkpoint from before run ids: the resumed run takes a new one)
    return DriverState(state["step"], state["consumed"], history,
                       state.get("run_id") or uuid.uuid4().hex, resumed_from=str(folder))


def read_driver_state(folder) -> tuple[dict, list[dict]]:
    """A checkpoint's driver state and its metrics so far, every field checked: one that loads
    weights-only yet is not what save_checkpoint writes (damaged, or crafted) stops the run here,
    in one line, rather than with a traceback once the models have loaded."""
    folder = Path(folder)
    state = load_state(folder / "driver_state.pt", mmap=True)
    state = state if isinstance(state, dict) else {}
    for key in ("step", "consumed"):
        if not _count(state.get(key)):
            _refuse(folder, f"driver_state.pt: {key} is not a count of steps ({state.get(key)!r})")
    if not isinstance(state.get("run_id", ""), (str, type(None))):
        _refuse(folder, f"driver_state.pt: run_id is not a string ({state['run_id']!r})")
    try:
        random.Random().setstate(state.get("python_rng"))  # (on throwaway generators)
    except (TypeError, ValueError):
        _refuse(folder, "driver_state.pt: python_rng is not a state of python's random")
    try:
        np.random.RandomState().set_state(_numpy_state(state.get("numpy_rng")))
    except (TypeError, ValueError, IndexError):
        _refuse(folder, "driver_state.pt: numpy_rng is not a state of numpy's random")
    if not (folder / "metrics.jsonl").is_file():
        _refuse(folder, "no metrics.jsonl (the run so far)")
    history, path = [], folder / "metrics.jsonl"
    try:
        for n, _, record in json_lines(path, said=lambda _: None):
            if not _count(record.get("step")):
                _refuse(folder, f"{path}, line {n}: no step")
            if record["step"] > state["step"]:
                _refuse(folder, f"{path}, line {n}: step {record['step']}, past the "
                                f"checkpoint's step {state['step']}")
            history.append(record)
    except DamagedLog as e:  # (not UTF-8, not JSON, not an object: named by its line)
        _refuse(folder, str(e))
    return state, history


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _numpy_state(saved) -> tuple:
    """numpy's RNG state from the lists a checkpoint keeps it as (loadable weights-only)."""
    kind, keys, *rest = saved
    return (kind, np.array(keys, dtype=np.uint32), *rest)


def _refuse(folder: Path, what: str):
    raise SystemExit(escaped(f"error: checkpoint {folder}: {what}; it is damaged, or not "
                             f"smolrl's: resume from another checkpoint with --resume "
                             f"PATH{_others(folder)}"))


def _others(folder: Path) -> str:
    others = sorted(p.name for p in folder.parent.glob("step_*") if p != folder)
    return f" (others there: {', '.join(others)})" if others else ""


def claim_checkpoints(out: Path, resume_dir: str = "") -> list[Path]:
    """Before anything is written: every checkpoint in <out>/checkpoints must belong to the run
    being started or resumed, or pruning (--keep-last), saving and --resume auto would mix two runs.
    A fresh run (no resume_dir) stops at any checkpoint there; a resumed run at any of another run
    id -- a resume into another --out is refused exactly as a fresh run is. Returns the
    checkpoints of this run that a resume from an earlier one of <out>/checkpoints leaves: those
    at later steps, another branch now, which the run moves aside whole (session.start_log)."""
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
    if not resume_dir or not in_checkpoints(out, resume_dir):
        return []
    return [p for p in found if _step_of(p) > checkpoint_step(resume_dir)]


def in_checkpoints(out: Path, checkpoint: str) -> bool:
    """Whether `checkpoint` is one of <out>/checkpoints (the branch in --out), not one elsewhere."""
    return Path(checkpoint).resolve().parent == (Path(out) / "checkpoints").resolve()


def recorded_setting(out, resume: str, config_file: str, key: str) -> str:
    """A choice the machine made for the run being resumed, as its checkpoint's config recorded
    it -- its "dtype", how its engine was "decoding" -- "" for a fresh run, or a checkpoint
    without one: a resumed run keeps it instead of timing again."""
    if not resume:
        return ""
    folder = Path(resume) if resume != "auto" else newest_checkpoint(out)
    try:
        return str(json.loads((folder / config_file).read_text()).get(key, ""))
    except (OSError, ValueError, TypeError, AttributeError):  # find_checkpoint names the problem
        return ""


def find_checkpoint(out: Path, resume: str, cfg=None) -> str:
    """--resume auto: the newest complete checkpoint in <out>/checkpoints; or the folder given --
    named through --out where it is one of <out>/checkpoints reached another way (the folder
    mounted twice), so that it is the branch in --out (in_checkpoints). Its files are checked
    here, before any model loads, so a damaged one is named at once -- and, given the run's
    config, one that another script wrote or whose model is built otherwise (same_kind)."""
    if resume != "auto":
        if not (Path(resume) / "driver_state.pt").exists():
            raise SystemExit(f"error: --resume {resume}: not a checkpoint folder (no driver_state.pt)")
        folder = Path(resume)
        try:
            if os.path.samefile(folder.parent, Path(out) / "checkpoints"):
                folder = Path(out) / "checkpoints" / folder.name
        except OSError:  # (no <out>/checkpoints)
            pass
    else:
        folder = newest_checkpoint(out)
        if folder is None:
            raise SystemExit(f"error: --resume auto: no checkpoint in {out / 'checkpoints'}")
    read_driver_state(folder)  # (the structure, not gigabytes of tensors: mmap)
    trainer = load_state(folder / "trainer_state.pt", mmap=True)
    trainer = trainer if isinstance(trainer, dict) else {}
    for key, kind in (("optimizer", dict), ("scheduler", dict), ("torch_rng", torch.Tensor)):
        if not isinstance(trainer.get(key), kind):
            _refuse(folder, f"trainer_state.pt: {key} is not a {kind.__name__}")
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
    if cfg is not None:
        same_kind(folder, cfg)
    return str(folder)


CONFIG_FILES = tuple(f"{name}_config.json" for name in ("sft", "rm", "dpo", "grpo", "ppo",
                                                        "distill"))  # (each Config's CONFIG_FILE)


def same_kind(folder: Path, cfg):
    """Refuse, before any model loads, a checkpoint another script wrote -- sft.py resuming
    grpo.py's would skip the steps GRPO took and carry its metrics into SFT's log; rm.py and
    ppo.py would fail half loaded -- or one whose weights do not fit the model this run builds
    (trained_with). The config a checkpoint carries (save_checkpoint copies it) says both; one
    without any says nothing."""
    ours = folder / cfg.CONFIG_FILE
    if not ours.is_file():
        theirs = [name for name in CONFIG_FILES if (folder / name).is_file()]
        if theirs:
            script = theirs[0].removesuffix("_config.json") + ".py"
            raise SystemExit(escaped(
                f"error: --resume {folder}: a checkpoint of {script} ({theirs[0]}), not of "
                f"{cfg.CONFIG_FILE.removesuffix('_config.json')}.py; resume it with {script}"))
        return
    try:
        recorded = json.loads(ours.read_text())
        recorded = recorded if isinstance(recorded, dict) else {}
    except (OSError, ValueError) as e:
        _refuse(folder, f"{ours.name} cannot be read ({type(e).__name__})")
    was = trained_with(recorded)
    now = trained_with({k: getattr(cfg, k) for k in WEIGHTS if hasattr(cfg, k)})
    for flag, value in was.items():
        if flag in now and now[flag] != value:
            raise SystemExit(escaped(
                f"error: --resume {folder}: its run trained with {flag} {value}, this one asks "
                f"for {now[flag]}; resume with {flag} {value} (a checkpoint resumes only the "
                f"model it was trained from, as it was trained)"))


WEIGHTS = ("lora_rank", "lora_alpha", "lora_targets", "model", "init_from")


def trained_with(config: dict) -> dict:
    """What a checkpoint's weights fit, by flag, from a run's config (its keys as saved; a key it
    lacks, from before the option, is not compared): full weights or LoRA of a rank, and the
    model trained -- a full-weights checkpoint holds the policy, but its tokenizer and KL
    reference load from --model again (resumed without it, the offline default's tokenizer would
    read another model's ids); for LoRA, whose checkpoint holds adapters only, also their scale
    and the layers they sit on (a set of names: their order and spaces say nothing)."""
    rank = config.get("lora_rank", 0)
    out = {"--lora-rank": rank} if "lora_rank" in config else {}
    if "model" in config:
        base = config.get("init_from") or config["model"]
        out["--model (or --init-from)"] = os.path.realpath(base) if isinstance(base, str) and \
            os.path.exists(base) else base  # (a folder however it is spelled)
    if not rank:
        return out
    if "lora_alpha" in config:  # (0: twice the rank, model.add_lora)
        alpha = config["lora_alpha"]
        out["--lora-alpha"] = alpha or 2 * rank if isinstance(rank, int) else alpha
    if "lora_targets" in config:
        out["--lora-targets"] = ",".join(sorted(set(lora_target_names(config["lora_targets"]))))
    return out


def newest_checkpoint(out: Path) -> Path | None:
    """What --resume auto takes: the checkpoint of <out>/checkpoints at the latest step (a folder
    a save is still writing, or left half-written, is a `.tmp-` one: never this)."""
    return max(_checkpoints(Path(out) / "checkpoints"), key=_step_of, default=None)


def load_state(path, mmap: bool = False) -> dict:
    """A training-state file, weights-only; a damaged or foreign one stops the run with one line
    that names it and says what to do."""
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:
        raise SystemExit(escaped(f"error: checkpoint {path.parent}: {path.name} cannot be "
                                 f"loaded safely ({type(e).__name__}): it is damaged, or holds "
                                 f"more than tensors and plain data, which smolrl never "
                                 f"unpickles. Resume from another checkpoint with --resume "
                                 f"PATH{_others(path.parent)}.")) from None


def checkpoint_step(folder) -> int:
    """The step a checkpoint was written after (its driver state's: a folder may be named
    anything)."""
    return load_state(Path(folder) / "driver_state.pt")["step"]


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def _run_of(checkpoint: Path) -> str | None:
    state = load_state(checkpoint / "driver_state.pt")
    return state.get("run_id") if isinstance(state, dict) else None  # (crafted: no run's)


def _checkpoints(folder: Path) -> list[Path]:
    return [p for p in folder.glob("step_*") if re.fullmatch(r"step_[0-9]+", p.name)
            and (p / "driver_state.pt").exists()]
