"""A run's folder, and the offline loop: what every algorithm does before its first step and after
its last, and the loop of sft.py, dpo.py and rm.py.

    folder = open_run(cfg)            # seeds; --out; the checkpoint to resume, never another run's
    ... the data checked, the models loaded ...
    resume_driver(folder)             # a resumed run's step, data position, RNGs and metrics
    start_log(folder, cfg, line)      # the metrics log, the config written to --out
    offline_loop(folder, cfg, rows, what, train_step, evaluate, save)   # sft.py, dpo.py, rm.py
    close_run(folder, export, title)  # the model alone in <out>/model, the curves

The RL loop (rl.py) opens and closes its runs with these too. One rule for every offline
algorithm: an epoch is ceil(rows / --batch-size) steps, its last batch short (as TRL's data loader
keeps it), and --steps, TRL's max_steps, overrides --epochs.
"""

import json
import os
import random
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from checkpoint import DriverState, claim_checkpoints, find_checkpoint, load_driver_state
from checkpoint import move_aside, save_checkpoint
from data import escaped
from evaluate import RunLog
from hardware import machine
from report import plot_curves, printable, write_report


@dataclass
class RunFolder:
    """A run's folder, as the loops work with it."""
    out: Path
    resume_dir: str  # the checkpoint a resumed run continues from ("": a fresh run)
    driver: DriverState | None = None  # the step, the data position, the metrics so far
    log: RunLog | None = None  # (start_log: once the models have loaded)


# What a run writes in --out, besides checkpoints/ (checkpoint.py): a fresh run moves a finished
# run's to <out>/superseded/<time>/ (supersede), and refuses anything but a file or nothing where
# its own files go (check_out).
RUN_FILES = ("metrics.jsonl", "rollouts.jsonl", "report.html", "curves.png", "machine.json")
RUN_FOLDERS = ("model", "checkpoints", "tensorboard", "wandb")


def open_run(cfg) -> RunFolder:
    """Seeds, --out, and the checkpoint a resumed run continues from (never another run's:
    checkpoint.claim_checkpoints). Nothing is loaded yet."""
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    check_out(out, cfg.CONFIG_FILE)
    out.mkdir(parents=True, exist_ok=True)
    resume_dir = find_checkpoint(out, cfg.resume) if cfg.resume else ""
    branched = claim_checkpoints(out, resume_dir)
    if branched:
        print(branched)
    return RunFolder(out, resume_dir)


def check_out(out: Path, config_file: str):
    """--out, before anything is loaded or written: a name the libraries can save under, a
    folder (or nothing yet), and where the run writes its files, a file or nothing -- a link is
    never followed (a fresh run would empty its target), a FIFO never opened (the run would
    block). One line each; nothing is changed."""
    try:
        os.path.abspath(out).encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(e.object[e.start]) - 0xDC00  # (os.fsdecode's stand-in for an undecodable byte)
        raise SystemExit(f"error: --out {printable(str(out))}: not a UTF-8 name (the byte "
                         f"0x{byte:02x}), under which the tokenizer library cannot save a model; "
                         f"choose another --out") from None
    if out.exists() and not out.is_dir():
        raise SystemExit(f"error: --out {out} is a file, not a folder; choose another --out")
    wanted = [(out / name, "a file") for name in (*RUN_FILES, config_file)]
    for path, want in wanted + [(out / "superseded", "a folder")]:
        kind = _kind(path)
        if kind and kind != want:
            raise SystemExit(f"error: {path} is {kind}, not {want}: a run writes its own files "
                             f"in --out and follows nothing there; remove it or choose another "
                             f"--out (nothing was changed)")


def _kind(path: Path) -> str:
    """What is at path, without following a link ("": nothing)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return ""
    return ("a file" if stat.S_ISREG(mode) else "a folder" if stat.S_ISDIR(mode) else
            "a symbolic link" if stat.S_ISLNK(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "a device")


def supersede(out: Path) -> str:
    """A fresh run's first write: the files and folders a run before it left in --out (its log,
    metrics, report, curves, config, model: checkpoint.claim_checkpoints has made sure no live
    checkpoint is among them) moved whole to <out>/superseded/<time>/; the line that says
    where ("" when there were none)."""
    found = sorted(p for p in out.iterdir() if p.name in RUN_FILES + RUN_FOLDERS
                   or p.name.endswith("_config.json"))
    if not found:
        return ""
    aside = move_aside(found, out / "superseded")
    return escaped(f"{out} held an earlier run: its {', '.join(p.name for p in found)} are "
                   f"moved whole to {aside} (delete it when you no longer need it; --resume "
                   f"continues a run instead)")  # (escaped: any name a folder holds)


def resume_driver(folder: RunFolder):
    """Where the run stands: a resumed run's step, data position and metrics, and its python and
    numpy RNGs restored (so: after whatever set-up draws from them, as the run it continues did);
    a fresh run's step 0."""
    folder.driver = load_driver_state(folder.resume_dir) if folder.resume_dir else DriverState()
    if folder.resume_dir:
        print(f"resuming from {folder.resume_dir} at step {folder.driver.step + 1}")


def start_log(folder: RunFolder, cfg, line=None):
    """The metrics log (metrics.jsonl and the trackers, a resumed run's history first) and the
    config, written to <out>/<cfg.CONFIG_FILE>; a fresh run first moves an earlier run's files
    aside (supersede)."""
    moved = "" if folder.resume_dir else supersede(folder.out)
    if moved:
        print(moved)
    folder.log = RunLog(folder.out, folder.driver.history, cfg.report_to, asdict(cfg), line)
    (folder.out / cfg.CONFIG_FILE).write_text(json.dumps(asdict(cfg), indent=2))
    (folder.out / "machine.json").write_text(json.dumps(machine(), indent=2))  # (for the report)


def close_run(folder: RunFolder, export, title: str, **plot):
    """After the last step: the model alone (optimizer state lives in checkpoints only) in
    <out>/model by export(folder), the curves, and the report page (report.py). A picture that
    cannot be drawn is a warning: the run's model and logs are saved whatever its figures."""
    folder.log.close()
    export(str(folder.out / "model"))
    saved = ["metrics.jsonl"]
    if _drawn(folder.out / "curves.png", lambda: plot_curves(
            folder.driver.history, folder.out / "curves.png", title=title, **plot)):
        saved.append("curves.png")
    if _drawn(folder.out / "report.html", lambda: write_report(folder.out)):
        saved.append("report.html (open it in a browser)")
    print(f"saved the model in {folder.out}/model/, {', '.join(saved)} in {folder.out}/")


def _drawn(path: Path, draw) -> bool:
    """draw(), or one warning line where it fails: whether `path` was drawn."""
    try:
        draw()
        return True
    except (Exception, SystemExit) as e:  # (SystemExit: report.py's one line on a damaged log)
        said = escaped(" ".join(str(e).split()))  # (it may quote a log's text)
        print(f"warning: {path} could not be drawn ({type(e).__name__}: {said}); the run is "
              f"saved, and `python report.py {path.parent}` tries the page again")
        return False


# ---------------------------------------------------------------------------------------------
# The offline loop.


@dataclass
class Batch:
    """One optimizer step of the offline loop: which rows, in which epoch."""
    step: int  # from 1
    epoch: int  # from 0
    rows: list[int]  # indices into the training rows


def epoch_batches(rows: int, batch_size: int, epochs: int, steps: int, seed: int) -> list[Batch]:
    """Every step's rows: each epoch the rows in an order of its own (seeded by the epoch, so the
    same on --resume), cut into ceil(rows / batch_size) batches -- the last one short, as TRL's
    data loader keeps it. steps > 0 overrides epochs, as TRL's max_steps does: epochs go on,
    each reshuffled, until that many steps are done."""
    per_epoch = -(-rows // batch_size)
    batches, order = [], []
    for step in range(1, (steps or per_epoch * epochs) + 1):
        epoch, b = divmod(step - 1, per_epoch)
        if b == 0:
            order = list(range(rows))
            random.Random(seed + epoch).shuffle(order)
        batches.append(Batch(step, epoch, order[b * batch_size:(b + 1) * batch_size]))
    return batches


def offline_loop(folder: RunFolder, cfg, rows: int, what: str, train_step, evaluate, save):
    """The steps of an offline run over `rows` training rows (`what`: the start-up line's
    account of the data): train_step(row indices) -> the step's metrics; evaluate() -> held-out
    metrics, at step 0, every --eval-every steps and at the end; save(folder) writes the
    trainer's half of a checkpoint every --save-every steps. A resumed run goes on from the step
    after its checkpoint, over the very batches the run would have taken."""
    batches = epoch_batches(rows, cfg.batch_size, cfg.epochs, cfg.steps, cfg.seed)
    driver, log = folder.driver, folder.log
    print(f"{what}; {len(batches)} steps of {cfg.batch_size}")
    if cfg.eval_every and driver.step == 0:
        log({"step": 0, **evaluate()})
    bar = tqdm(total=len(batches), desc=type(cfg).__module__, unit="step", initial=driver.step)
    for batch in batches[driver.step:]:
        record = {"step": batch.step, "epoch": batch.epoch, **train_step(batch.rows)}
        if cfg.eval_every and (batch.step % cfg.eval_every == 0 or batch.step == len(batches)):
            record.update(evaluate())
        log(record)
        bar.update(1)
        if cfg.save_every and batch.step % cfg.save_every == 0:
            driver.step = driver.consumed = batch.step
            save_checkpoint(folder.out, driver, save, cfg.keep_last)
    bar.close()
