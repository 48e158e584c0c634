"""A run's folder, and the offline loop: what every algorithm does before its first step and after
its last, and the loop of sft.py, dpo.py and rm.py.

    folder = open_run(cfg)            # seeds; --out locked; the checkpoint to resume, never another
                                      # run's; what the run would overwrite; room on the disk
    ... the data checked, the models loaded ...
    resume_driver(folder)             # a resumed run's step, data position, RNGs and metrics
    start_log(folder, cfg, line)      # the run before moved aside; the metrics log, the config;
                                      # from here SIGTERM and Ctrl-C stop it after a step
    offline_loop(folder, cfg, rows, what, train_step, evaluate, save)   # sft.py, dpo.py, rm.py
    after_step(folder, cfg, save)     # every step's end, in every loop: the checkpoint when due,
                                      # and when a signal asked the run to stop (then it exits)
    close_run(folder, export, title)  # the model alone in <out>/model, the curves; --out unlocked

    @one_run                          # each algorithm's main: a run that fails leaves no signal
    def main(cfg): ...                # handler or grace timer behind it in a process that goes on

What a run may do to its folder, and never does, is run_folder.py's. The RL loop (rl.py) opens
and closes its runs with these too. One rule for every offline algorithm: an epoch is
ceil(rows / --batch-size) steps, its last batch short (as TRL's data loader keeps it), and
--steps, TRL's max_steps, overrides --epochs.
"""

import functools
import json
import os
import random
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from charts import plot_curves
from checkpoint import DriverState, find_checkpoint, load_driver_state, newest_checkpoint
from checkpoint import save_checkpoint
from cli import readable_paths
from data import escaped
from evaluate import RunLog, log_in_trackers
from hardware import DECODE_PINS, machine
from report import write_report
from run_folder import check_movable, check_out, check_room, left_behind, lock_out
from run_folder import prune_superseded, read_paths, recover_export, release_out, room_left
from run_folder import samples_of, set_aside
from stopping import asked, catch_stop_signals, exit_now, release_stop_signals


@dataclass
class RunFolder:
    """A run's folder, as the loops work with it."""
    out: Path
    resume_dir: str  # the checkpoint a resumed run continues from ("": a fresh run)
    aside: list[Path] = field(default_factory=list)  # what start_log moves to superseded/
    samples: Path | None = None  # the rollouts.jsonl whose records up to its step a resumed run
    # keeps (beside its checkpoint; where start_log moved it)
    reads: list[Path] = field(default_factory=list)  # what the run's flags name: never pruned
    driver: DriverState | None = None  # the step, the data position, the metrics so far
    log: RunLog | None = None  # (start_log: once the models have loaded)


def one_run(main):
    """An algorithm's main(cfg), which hands the signals back however the run ends: one that
    fails -- after a signal, say, its step raising -- leaves no grace timer (stopping.py) to
    end the process that goes on (a notebook) a while later, and the handlers from before it
    back. (Its --out lock stays until the next run there or the process's end: run_folder.py.)"""
    @functools.wraps(main)
    def run(cfg):
        try:
            with readable_paths(vars(cfg)):  # (a flag's path this user may not reach)
                return main(cfg)
        finally:
            release_stop_signals()
    return run


def open_run(cfg) -> RunFolder:
    """Seeds; --out checked and locked for this run (run_folder.lock_out); the checkpoint a
    resumed run continues from (checked whole: checkpoint.find_checkpoint), never another run's;
    what of the run before the first write will move aside (run_folder.left_behind); room on the
    disk. Nothing is loaded, moved or deleted yet; a run refused here leaves --out unlocked."""
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    check_out(out, cfg.CONFIG_FILE)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # (a file on its path, a folder not the user's, a read-only disk)
        raise SystemExit(f"error: --out {out}: cannot make that folder ({e.strerror}); choose "
                         f"another --out") from None
    lock_out(out)
    try:
        recovered = recover_export(out)
        if recovered:
            print(recovered)
        resume_dir = find_checkpoint(out, cfg.resume, cfg) if cfg.resume else ""
        reads = read_paths(cfg) + ([Path(resume_dir).resolve()] if resume_dir else [])
        folder = RunFolder(out, resume_dir, left_behind(out, resume_dir), samples_of(resume_dir),
                           reads)
        check_room(out, cfg, reads, moving=folder.aside)
        check_movable(out, folder.aside)
        log_in_trackers(cfg.report_to)
    except BaseException:  # (a refusal, or a fault: --out free again for the next run)
        release_out(out)
        raise
    return folder


def resume_driver(folder: RunFolder):
    """Where the run stands: a resumed run's step, data position and metrics, and its python and
    numpy RNGs restored (so: after whatever set-up draws from them, as the run it continues did);
    a fresh run's step 0."""
    folder.driver = load_driver_state(folder.resume_dir) if folder.resume_dir else DriverState()
    if folder.resume_dir:
        print(f"resuming from {folder.resume_dir} at step {folder.driver.step + 1}")


def start_log(folder: RunFolder, cfg, line=None, decoding: str = ""):
    """The run's first write, once its models have loaded: what it would overwrite or drop moved
    aside whole (run_folder.set_aside: a fresh run, the run before it; a resumed one, the branch
    it leaves), superseded/ pruned to --keep-superseded; then the config, written to
    <out>/<cfg.CONFIG_FILE> with how the run's HF engines are `decoding` (rollout.decoding_mode,
    which a resumed run reads back as cfg.decoding: options.settle; without an engine, what it
    read back), and the metrics log (metrics.jsonl and the trackers, a resumed run's history
    first)."""
    moved, aside, folder.samples = set_aside(folder.out, folder.aside, folder.resume_dir,
                                             folder.samples)
    kept = folder.reads + ([aside] if aside else [])  # (never the run just moved aside)
    for said in (moved, prune_superseded(folder.out, cfg.keep_superseded, kept)):
        if said:
            print(said)
    # (no engine this leg -- SFT resumed without its evaluation, say: the run's record carries
    # on, for a later leg's engine to decode as the first did)
    decoding = decoding or (cfg.decoding if getattr(cfg, "decoding", "") in DECODE_PINS else "")
    recorded = {**asdict(cfg), **({"decoding": decoding} if decoding else {})}
    write_beside(folder.out / cfg.CONFIG_FILE, json.dumps(recorded, indent=2))  # (first: what
    # marks a run's folder, run_folder.left_behind)
    folder.log = RunLog(folder.out, folder.driver.history, cfg.report_to, asdict(cfg), line)
    write_beside(folder.out / "machine.json", json.dumps(machine(), indent=2))  # (the report's)
    # From here on a signal stops the run after its step, with a checkpoint (after_step). Not
    # sooner: before this nothing is trained, nothing in --out has changed, and a run loading
    # its models ends at once; and Ray, started by now, has set SIGTERM handlers of its own.
    catch_stop_signals(cfg.stop_grace, lambda signum: give_up(folder, cfg, signum))


def write_beside(path: Path, text: str):
    """`text` in a new file beside `path`, renamed over it: a resumed run's file hard-linked to
    another folder's (a copy by `cp -al`, a backup by rsync --link-dest) keeps that one's bytes,
    and a link there is replaced, never written through."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    with open(tmp, "x") as f:
        f.write(text)
    os.replace(tmp, path)


def close_run(folder: RunFolder, export, title: str, **plot):
    """After the last step: the model alone (optimizer state lives in checkpoints only) in
    <out>/model by export(folder), the curves, and the report page (report.py); --out unlocked.
    A picture that cannot be drawn is a warning: the run's model and logs are saved whatever its
    figures."""
    folder.log.close()
    export(str(folder.out / "model"))
    saved = ["metrics.jsonl"]
    if _drawn(folder.out / "curves.png", lambda: plot_curves(
            folder.driver.history, folder.out / "curves.png", title=title, **plot)):
        saved.append("curves.png")
    if _drawn(folder.out / "report.html", lambda: write_report(folder.out)):
        saved.append("report.html (open it in a browser)")
    print(f"saved the model in {folder.out}/model/, {', '.join(saved)} in {folder.out}/")
    release_out(folder.out)
    release_stop_signals()


def after_step(folder: RunFolder, cfg, save, good: bool = True):
    """A step's end, in every loop (offline_loop, rl.end_step): its checkpoint every --save-every
    steps (good: a step whose update was not skipped), and whenever a signal has asked the run to
    stop (stopping.py; a skipped update's step too: its weights are the last good ones, and
    nothing else would be kept) -- which it then does, in one line naming the checkpoint and the
    command that resumes it, with exit code 128 + the signal's number, as a shell reports it."""
    step, written = folder.driver.step, False
    if asked() or (cfg.save_every and step % cfg.save_every == 0 and good):
        write_checkpoint(folder, cfg, save)
        written = True
    signum = asked()  # (also one that came during that save: the step's checkpoint is written)
    if signum:
        if not written:
            write_checkpoint(folder, cfg, save)
        folder.log.close()
        release_stop_signals()
        release_out(folder.out)
        tqdm.write(escaped(f"stopped after step {step} (signal {signum}): checkpoint "
                           f"{folder.out / 'checkpoints' / f'step_{step}'}; resume with: "
                           f"{resume_command(cfg)}"), file=sys.stderr)  # (a line of its own,
        # not glued to the progress bar's)
        raise SystemExit(128 + signum)


def write_checkpoint(folder: RunFolder, cfg, save):
    """This step's checkpoint (checkpoint.save_checkpoint; save: the trainer's half). A write
    that fails -- a full disk, a file-size limit -- stops the run in one line: the checkpoint,
    the disk's room, the previous checkpoint, whole, and the command that resumes from it."""
    try:
        save_checkpoint(folder.out, folder.driver, save, cfg.keep_last)
    except OSError as e:
        release_stop_signals()  # (the run ends here)
        last = newest_checkpoint(folder.out)
        then = (f"The previous checkpoint, {last}, is whole: make room, then resume with: "
                f"{resume_command(cfg)}" if last else "No checkpoint was written before it: "
                                                       "make room, then run again")
        target = folder.out / "checkpoints" / f"step_{folder.driver.step}"
        raise SystemExit(escaped(f"error: checkpoint {target} could not be written "
                                 f"({e.strerror or e}; {room_left(folder.out)}); nothing of it "
                                 f"is kept. {then}")) from None


def give_up(folder: RunFolder, cfg, signum: int):
    """A step that outlasts --stop-grace after a signal (stopping.py's timer, in a thread of its
    own): one line naming the last checkpoint, whole, and the process ends."""
    last = newest_checkpoint(folder.out)
    kept = (f"the last checkpoint, {last}, is whole: resume with: {resume_command(cfg)}" if last
            else "no checkpoint was written before it (--save-every N writes them)")
    release_out(folder.out)
    exit_now(signum, escaped(f"error: the step under way did not end, and save, within "
                             f"--stop-grace {cfg.stop_grace:g} s of signal {signum}: it is given "
                             f"up; {kept}"))


def resume_command(cfg) -> str:
    """The command that goes on from the newest checkpoint in --out: the one that started this
    process (sys.argv, where it is the algorithm's script) with `--resume auto` for any --resume;
    for a run started otherwise (a notebook, a test), the script and --out."""
    module = type(cfg).__module__
    if module in ("__main__", Path(sys.argv[0]).stem):
        args, argv = [], iter(sys.argv[1:])
        for arg in argv:
            if arg == "--resume":
                next(argv, None)
            elif not arg.startswith("--resume="):
                args.append(arg)
        return f"python {shlex.join([sys.argv[0], *args, '--resume', 'auto'])}"
    return f"python {module}.py --out {shlex.quote(cfg.out)} --resume auto (and its other options)"


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
    trainer's half of a checkpoint every --save-every steps, and when a signal stops the run
    (after_step). A resumed run goes on from the step after its checkpoint, over the very
    batches the run would have taken."""
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
        driver.step = driver.consumed = batch.step
        after_step(folder, cfg, save)
    bar.close()
