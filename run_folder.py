"""What a run may do to its --out, and what it never does: the rules that keep everything a user
made there, in one place (session.py calls them; docs/long-runs.md says them for users).

    check_out(out, config_file)        before anything: --out, and the names a run writes there
    lock_out(out) ... release_out(out) one run at a time in --out, for the run's whole life
    recover_export(out)                a run killed inside its export: the model it replaced back
    left_behind(out, resume_dir)       what of the run before it a run would overwrite or drop
    check_room(out, cfg, ...)          room on the disk for the run's model and a checkpoint
    room_left(out)                     the same disk's room in words, when a write has failed
    set_aside(out, paths, ...)         at the first write: those moved whole to superseded/<time>/
    prune_superseded(out, keep, reads) superseded/ bounded to the newest --keep-superseded folders

1. Nothing moves and nothing is deleted before the run's models have loaded, and everything the
   run reads -- its models, data, checkpoint -- is read by then: --model (--init-from, --teacher)
   may name the run's own --out, whose model/ the run moves aside.
2. One run at a time holds --out: an exclusive flock on <out>/.smolrl.lock, held open for the
   run's life and released by the kernel however the process ends (kill -9 included). The file
   names the holder (pid, host, since when, command) for the line that refuses a second run; a
   name left by a holder that did not release it (killed) is taken over, and said. Under Ray the
   driver holds it. Over a shared filesystem flock reaches other hosts where the filesystem
   shares locks (NFS does; Lustre only mounted with -o flock): a filesystem that refuses locks
   gets a warning, and the run goes on unguarded. Nor does a run start inside another run
   folder's model/, checkpoints/, superseded/ (which that run replaces, moves or prunes whole),
   nor move a running run's folder aside.
3. A run moves aside, whole, what it would overwrite or drop: a fresh run, the run before it; a
   resumed run, the branch it leaves or the run in a folder it resumes into (checkpoint.py says
   which). Each move is a new folder <out>/superseded/<time>/, laid out as a run folder.
4. superseded/ keeps its newest --keep-superseded folders that hold weights (0: all; those
   without -- the logs of a run stopped before or inside its first save -- are all kept, and
   never push a trained model out); the run says which it deletes, and never deletes one that
   holds a path the run's flags name, nor one another run writes in, nor the one it has just
   moved there.
5. Before the models load: room on the disk for what the run must write -- its model and, with
   --save-every, a checkpoint --, counting what pruning will free; else one line. (A disk that
   fills later, inside a checkpoint, is said with room_left: session.write_checkpoint.)
"""

import atexit
import fcntl
import json
import os
import re
import resource
import shutil
import socket
import stat
import sys
import time
from pathlib import Path

from checkpoint import CONFIG_FILES, checkpoint_step, claim_checkpoints, in_checkpoints
from data import escaped, printable
from model import DEFAULT_MODEL, default_model_folder
from reward import weighted

# What a run writes in --out, besides checkpoints/ (checkpoint.py) and its lock.
RUN_FILES = ("metrics.jsonl", "rollouts.jsonl", "report.html", "curves.png", "machine.json")
RUN_FOLDERS = ("model", "checkpoints", "tensorboard", "wandb")
LOCK = ".smolrl.lock"
STAMP = re.compile(r"\d{8}-\d{6}\+*")  # a superseded folder's name: the time of its move
TEMP = re.compile(r"\..+-[a-z0-9_]{8}")  # a folder's name as tempfile.mkdtemp makes it, with a
# prefix: an export's (.model-, .old-model-) and a checkpoint's (..tmp-step_N-, .old-.tmp-step_N-)


def check_out(out: Path, config_file: str):
    """--out, before anything is loaded or written: a name the libraries can save under, a
    folder (or nothing yet) not inside a run folder's model/, checkpoints/, superseded/ (what
    that run replaces, moves or prunes whole), and where the run writes its files, a file or
    nothing -- a link is never followed (a fresh run would empty its target), a FIFO never
    opened (the run would block). One line each; nothing is changed."""
    try:
        os.path.abspath(out).encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(e.object[e.start]) - 0xDC00  # (os.fsdecode's stand-in for an undecodable byte)
        raise SystemExit(f"error: --out {printable(str(out))}: not a UTF-8 name (the byte "
                         f"0x{byte:02x}), under which the tokenizer library cannot save a model; "
                         f"choose another --out") from None
    if out.exists() and not out.is_dir():
        raise SystemExit(f"error: --out {out} is a file, not a folder; choose another --out")
    real = Path(os.path.realpath(out))
    for run in real.parents:  # (a run folder above: its model/ it replaces, its superseded/ ...)
        part = real.relative_to(run).parts[0]
        if part not in RUN_FOLDERS + ("superseded",):
            continue
        if any((run / name).is_file() for name in CONFIG_FILES):
            raise SystemExit(f"error: --out {out} lies in {run / part}, which the run in {run} "
                             f"replaces, moves aside or prunes whole; choose an --out of its "
                             f"own (nothing was changed)")
        if str(run) not in _held and (holder := running(run)):  # (a run that has not written
            # its config yet; this process's own stopped runs aside)
            raise SystemExit(f"error: --out {out} lies in {run}, the --out of a run that is "
                             f"running ({holder}), which would move or replace it; choose "
                             f"another --out (nothing was changed)")
    wanted = [(out / name, "a file") for name in (*RUN_FILES, config_file, LOCK)]
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
    except (FileNotFoundError, NotADirectoryError):  # (a file above it: open_run says so)
        return ""
    return ("a file" if stat.S_ISREG(mode) else "a folder" if stat.S_ISDIR(mode) else
            "a symbolic link" if stat.S_ISLNK(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "a device")


# ---------------------------------------------------------------------------------------------
# One run at a time (rule 2).

_held: dict[str, int] = {}  # --out (its real path) -> the lock file this process holds open


def recover_export(out: Path) -> str:
    """What a run killed inside its export or a checkpoint's save left in its --out
    (model.save_model writes the whole model beside its folder, then model.replace_folder renames
    the old one aside and the new one into place): killed between the two renames, the swap
    finished -- the new model, written whole, in model/ -- or, were there none beside it, the old
    one put back; half-written copies (.model-*, checkpoints/..tmp-step_*-*, the .old-* of a
    swap that finished) deleted. Only in a run's folder (its *_config.json), and only names as
    tempfile.mkdtemp makes them: a user's .model-cache/ is no export's. Called with the lock
    held: no live run writes them. The line that says what was put in place ("" when nothing)."""
    if not any((out / name).is_file() for name in CONFIG_FILES):
        return ""
    said, made = "", lambda p: TEMP.fullmatch(p.name) and p.is_dir() and not p.is_symlink()
    new = [p for p in out.glob(".model-*") if made(p)]
    for old in sorted(p for p in out.glob(".old-model-*") if made(p)):
        if (old / "model").is_dir() and not os.path.lexists(out / "model"):
            if len(new) == 1:  # (the old one is renamed aside only once the new one is whole)
                os.replace(new.pop(), out / "model")
                said = (f"{out / 'model'}: a run was stopped between the two renames of its "
                        f"export; the model it had written whole is put in place")
            else:
                os.replace(old / "model", out / "model")
                said = (f"{out / 'model'} put back: a run was stopped while it replaced that "
                        f"model with its own, which it had not finished writing")
    halves = [*out.glob(".old-model-*"), *out.glob(".model-*"),
              *out.glob("checkpoints/..tmp-step_*-*"), *out.glob("checkpoints/.old-.tmp-step_*")]
    for half in filter(made, halves):
        shutil.rmtree(half, ignore_errors=True)
    return escaped(said)


def lock_out(out: Path):
    """--out for this run alone until release_out or the end of the process (rule 2). A run of
    this very process before it (a test's, a notebook's) that did not release it hands it on."""
    key = os.path.realpath(out)
    if key in _held and not _same_file(_held[key], out / LOCK):  # (the folder deleted and made
        release_out(out)  # again since: the lock kept is of a file gone)
    if key not in _held:
        try:
            fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise SystemExit(f"error: --out {out}: cannot write there ({e.strerror}); choose "
                             f"another --out") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise SystemExit(f"error: --out {out} is in use by another run ({holder}): wait for "
                             f"it to end, or choose another --out (nothing was changed)") from None
        except OSError as e:  # (ENOLCK, EOPNOTSUPP: a filesystem that keeps no locks)
            print(f"warning: --out {out}: its filesystem cannot lock files ({e.strerror}): a "
                  f"second run into it at once would not be stopped")
        else:
            if os.fstat(fd).st_size:  # (a holder's name, left: it did not release the lock)
                print(f"--out {out} was held by a run that ended without releasing it "
                      f"({_holder(fd)}): this run takes it over")
        _held[key] = fd
    name = {"pid": os.getpid(), "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}
    os.ftruncate(_held[key], 0)
    os.pwrite(_held[key], json.dumps(name).encode(), 0)


def release_out(out: Path):
    """The end of a run: its name cleared from the lock file, the lock released."""
    fd = _held.pop(os.path.realpath(out), None)
    if fd is not None:
        os.ftruncate(fd, 0)
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)  # (for a forked child's copy of the descriptor, too)
        except OSError:  # (a filesystem without locks: none was taken)
            pass
        os.close(fd)


@atexit.register
def _clear_names():
    """A process that ends, however it ends short of being killed, leaves no holder's name: a
    name found by the next run is one a killed run left."""
    for fd in _held.values():
        os.ftruncate(fd, 0)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.lstat(path))
    except OSError:
        return False


def _holder(fd: int) -> str:
    """The run the lock file names, in words."""
    text = os.pread(fd, 4096, 0)
    try:
        h = json.loads(text)
        said = escaped(f"pid {h['pid']} on {h['host']}, since {h['since']}: "
                       f"{h['command'][:120]}")  # (a crafted lock file's text: escaped)
    except (ValueError, TypeError, KeyError):
        return "whose name is not written yet" if not text else "whose name cannot be read"
    if h["host"] == socket.gethostname() and not _alive(h["pid"]):
        said += (f"; pid {h['pid']} is gone, but a process it started holds the lock still "
                 f"(`fuser -v {LOCK}` in --out names it)")
    return said


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True
    return True


def running(folder: Path) -> str:
    """The run that holds `folder` as its --out now, in words (this process's own runs
    included); "" where none does."""
    try:
        fd = os.open(folder / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return ""
    except BlockingIOError:
        return _holder(fd)
    except OSError:
        return ""
    finally:
        os.close(fd)


def _running_in(folder: Path) -> tuple[Path, str] | None:
    """A folder at or under `folder` that a run holds as its --out now, and that run in words."""
    for root, _, names in os.walk(folder):  # (links not followed)
        if LOCK in names and (holder := running(Path(root))):
            return Path(root), holder
    return None


# ---------------------------------------------------------------------------------------------
# What a run leaves behind, moved aside whole (rule 3), and superseded/ bounded (rule 4).


def left_behind(out: Path, resume_dir: str) -> list[Path]:
    """The paths of --out that the run, at its first write, moves aside whole: a fresh run's, or
    one's resumed from a checkpoint elsewhere (a superseded branch, another folder): every run
    file there, checkpoints/ included (claim_checkpoints refuses another run's live ones). A run
    resumed from one of <out>/checkpoints continues the branch there, so nothing -- unless that
    branch went further: then the branch it leaves, its later checkpoints and every run file. (A
    crashed run's steps past its newest checkpoint are taken again, exactly: dropped.) Only an
    earlier run's, which wrote its config there, are moved: anything else is refused (a user's
    own folder, whose wandb/ or model/ a run must not take for a run's, to delete with
    superseded/)."""
    later = claim_checkpoints(out, resume_dir)
    files = sorted(p for p in out.iterdir() if p.name in RUN_FILES + RUN_FOLDERS + CONFIG_FILES
                   and not (p.is_dir() and not any(p.iterdir())))  # (an empty folder: nothing
    # of a run's, perhaps a link the user made for this one: checkpoints/ on a bigger disk)
    if resume_dir and in_checkpoints(out, resume_dir) and not later and \
            not _went_past(out, checkpoint_step(resume_dir)):
        return []
    for live in filter(None, map(_running_in, files)):
        raise SystemExit(f"error: {live[0]} is the --out of a run that is running ({live[1]}), "
                         f"which this run would move aside; wait for it to end, or choose "
                         f"another --out (nothing was changed)")
    if files and not any(p.name in CONFIG_FILES for p in files):
        raise SystemExit(f"error: --out {out} holds {', '.join(p.name for p in files)}, but no "
                         f"smolrl run's config (a *_config.json): not an earlier run, which a "
                         f"run would move aside; choose another --out, or move them away "
                         f"yourself (nothing was changed)")
    moving = files if not (resume_dir and in_checkpoints(out, resume_dir)) else \
        later + [p for p in files if p.name != "checkpoints"]
    if moving and _kind(out / "superseded") == "a folder" and \
            os.lstat(out / "superseded").st_dev != os.stat(out).st_dev:  # (a mount point)
        raise SystemExit(f"error: {out / 'superseded'} lies on another filesystem than {out}, "
                         f"whose run files this run would move there whole, with a rename that "
                         f"cannot cross disks; make it a folder of {out}'s disk, or choose "
                         f"another --out (nothing was changed)")
    for p in moving:
        if os.lstat(p).st_dev != os.stat(out).st_dev:  # (through a link: a rename cannot move it)
            raise SystemExit(f"error: {p} lies on another filesystem than {out}, whose "
                             f"superseded/ this run would move it to whole; move it away "
                             f"yourself, or choose another --out (nothing was changed)")
    return moving


def _went_past(out: Path, step: int) -> bool:
    """Whether the run in --out finished past `step`: its final model there, and its metrics
    past the step (where they cannot be read, assumed so)."""
    if not (out / "model").exists():
        return False
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return max(json.loads(line)["step"] for line in lines if line.strip()) > step
    except (OSError, ValueError, TypeError, KeyError):  # (no metrics at all: ValueError)
        return True


def check_movable(out: Path, paths: list[Path]):
    """Before any model loads: that set_aside can move `paths` (--out's earlier run or
    evaluation, or a branch's later checkpoints) to <out>/superseded/ -- a folder there, on
    --out's disk (rename moves nothing between disks); this user may write in it, in --out, in
    each path's folder and in each folder to move (its `..` changes; not a link's target); and
    where a path's folder has the sticky bit (/tmp's kind) and is another user's, owns each path
    -- so the first write does not fail after the models loaded and the work is done."""
    def refuse(why: str):
        raise SystemExit(escaped(f"error: --out {out} holds an earlier run's or evaluation's "
                                 f"{', '.join(p.name for p in paths)}, which it would move aside, "
                                 f"but {why}: choose another --out"))
    if not paths:
        return
    aside, mine = out / "superseded", os.geteuid()
    if os.path.lexists(aside) and (aside.is_symlink() or not aside.is_dir()):
        refuse(f"{aside} is not a folder of its own (a file or a link: move it away)")
    mounted = mount_points()
    for path in [aside, *paths]:
        if path.is_dir() and (path.stat().st_dev != out.stat().st_dev or
                              os.path.realpath(path) in mounted):
            refuse(f"{path} is a mount, which files cannot be moved into or out of")
    for folder in sorted({out, aside, *(p.parent for p in paths)}):
        if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK, effective_ids=True):
            refuse(f"this user (uid {mine}) may not write in {folder}")
    for folder in (p for p in paths if p.is_dir() and not p.is_symlink()):  # (its `..` changes)
        if not os.access(folder, os.W_OK, effective_ids=True):
            refuse(f"this user (uid {mine}) may not write in {folder}")
    for p in paths:
        where = p.parent.stat()
        if where.st_mode & stat.S_ISVTX and mine not in (where.st_uid, p.lstat().st_uid) \
                and not moves_anyones():
            refuse(f"{p.name} is another user's, in a folder (sticky) where only its owner may "
                   f"move it")


def mount_points() -> set[str]:
    """Where filesystems are mounted (/proc/self/mountinfo's fifth field; a bind mount of the
    same disk too, which st_dev does not tell apart), empty where it cannot be read."""
    try:
        with open("/proc/self/mountinfo") as f:
            return {re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), line.split()[4])
                    for line in f if len(line.split()) > 4}
    except OSError:
        return set()


def moves_anyones() -> bool:
    """Whether this process may move another user's files out of a sticky folder: it holds
    CAP_FOWNER (root, unless a container dropped it)."""
    try:
        with open("/proc/self/status") as f:
            effective = next(line for line in f if line.startswith("CapEff:")).split()[1]
        return bool(int(effective, 16) >> 3 & 1)  # (CAP_FOWNER is capability 3)
    except (OSError, StopIteration, ValueError, IndexError):
        return os.geteuid() == 0


def set_aside(out: Path, paths: list[Path], resume_dir: str, samples: Path | None
              ) -> tuple[str, Path | None, Path | None]:
    """`paths` moved whole to a new <out>/superseded/<time>/, each to its place there (nothing
    copied, nothing deleted): the line that says what went where ("" when nothing), that folder
    (None when nothing), and where `samples` (a resumed run's rollouts.jsonl, which may be among
    them) lies now."""
    if not paths:
        return "", None, samples
    moved = {p.resolve(): p.relative_to(out) for p in paths}
    where = moved.get(samples.resolve()) if samples is not None else None
    aside = out / "superseded" / time.strftime("%Y%m%d-%H%M%S")
    while aside.exists():
        aside = aside.with_name(aside.name + "+")
    for p in sorted(paths, key=lambda p: p.name in CONFIG_FILES):  # (the config last: a run
        # killed half way leaves it with the rest, still a run's folder: left_behind)
        (aside / p.relative_to(out)).parent.mkdir(parents=True, exist_ok=True)
        os.replace(p, aside / p.relative_to(out))
    names = ", ".join(p.relative_to(out).as_posix() for p in paths)
    if not resume_dir:
        line = (f"{out} held an earlier run: its {names} are moved whole to {aside} (delete it "
                f"when you no longer need it; --resume continues a run instead)")
    elif in_checkpoints(out, resume_dir):
        later = [p for p in paths if p.parent.name == "checkpoints"]
        back = (f"--resume {aside / 'checkpoints' / later[-1].name} goes back to it" if later
                else f"its final model is {aside / 'model'}")
        line = (f"resuming from {Path(resume_dir).name}: what this run wrote past it, another "
                f"branch now ({names}), is moved whole to {aside} (--resume auto will not pick "
                f"it; {back})")
    else:
        line = (f"{out} held another run, or another branch of this one: its {names} are moved "
                f"whole to {aside} (delete it when you no longer need it)")
    return escaped(line), aside, aside / where if where is not None else samples  # (names: escaped)


def prune_superseded(out: Path, keep: int, reads: list[Path]) -> str:
    """<out>/superseded/ down to its newest `keep` folders with weights (0: all kept; _doomed):
    the line that says which were deleted ("" when none). Never one that holds a path in `reads`
    (the folder the run has just moved aside among them: its name, a local time, need not sort
    last), nor another run's --out."""
    doomed = _doomed(out, keep, reads)
    failed = []
    for folder in doomed:
        try:
            shutil.rmtree(folder)
        except OSError as e:
            failed.append(f"{folder.name} ({e.strerror})")
    if not doomed:
        return ""
    line = (f"{out / 'superseded'} keeps its newest {keep} (--keep-superseded): "
            f"{', '.join(p.name for p in doomed)} deleted")
    return escaped(line + (f"; warning: not all of {', '.join(failed)}" if failed else ""))


def _doomed(out: Path, keep: int, reads: list[Path], coming: list[Path] = ()) -> list[Path]:
    """The folders of <out>/superseded that keeping the newest `keep` that hold weights deletes,
    with the paths `coming` to be moved there first: time-named folders only, and none that holds
    a path in `reads` or that a run holds as its --out."""
    folder = out / "superseded"
    if not keep or _kind(folder) != "a folder":
        return []
    found = sorted(p for p in folder.iterdir() if STAMP.fullmatch(p.name)
                   and _kind(p) == "a folder" and _weights(p.iterdir()))  # (the names sort as
    # the times do)
    old = found[:max(0, len(found) + _weights(coming) - keep)]
    held = {_identity(q) for r in reads for q in (r, *r.parents)}  # (by what they are, not by
    # their paths: a folder mounted twice has two)
    return [p for p in old if not _running_in(p) and _identity(p) not in held]


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _weights(paths) -> bool:
    """Whether the paths of a run folder (a superseded one's entries, or what is to move there)
    hold weights: its model/, or a checkpoint -- a whole one: a save stopped half way (a full
    disk, Ctrl-C) leaves a .tmp-step_N that nothing resumes from, and is no trained model's
    match."""
    def whole(checkpoint: Path) -> bool:
        return checkpoint.name.startswith("step_") and (checkpoint / "driver_state.pt").is_file()
    return any(p.name == "model" or (p.parent.name == "checkpoints" and whole(p)) or
               (p.name == "checkpoints" and any(map(whole, p.glob("step_*")))) for p in paths)


READ_FLAGS = ("model", "init_from", "teacher", "critic_from", "reward_model", "judge",
              "judge_prompt", "data", "eval_data", "replay", "resume")
WEIGHTED = ("reward_model", "judge")  # (`path=weight` lists)


def read_paths(cfg) -> list[Path]:
    """The files and folders the run's flags name that exist (a `path=weight` list's paths
    too, reward.weighted's way: a path may hold a `=`), resolved: what pruning superseded/ never
    deletes under the run."""
    items = []
    for name in READ_FLAGS:
        value = str(getattr(cfg, name, None) or "")
        items += [path for path, _ in weighted(value, paths=True)] if name in WEIGHTED \
            else value.split(",")
    return [Path(item.strip()).resolve() for item in items
            if item.strip() and Path(item.strip()).exists()]


def samples_of(resume_dir: str) -> Path | None:
    """The rollouts.jsonl of the run folder a checkpoint lies in (<folder>/checkpoints/step_N):
    the samples a run resumed from it keeps, up to its step (None: a fresh run)."""
    checkpoint = Path(resume_dir)
    if resume_dir and checkpoint.parent.name == "checkpoints":
        return checkpoint.parent.parent / "rollouts.jsonl"
    return None


# ---------------------------------------------------------------------------------------------
# Room on the disk (rule 5).


def check_room(out: Path, cfg, reads: list[Path], moving: list[Path]):
    """Before any model loads: room on --out's disk for its model (the size of the weights the
    run starts from: its export is the same model, in the dtype it came in) and, with
    --save-every, a checkpoint (the weights in fp32 and AdamW's two moments; a LoRA run's, its
    adapters: not counted), counting what pruning superseded/ will free (`moving`: what is to
    be moved there first). One line where there is not; a model not on disk yet (a hub id,
    the default before its conversion) is not measured."""
    start = _start_folder(cfg)
    try:
        files = list(start.iterdir()) if start else []
        weights = sum(f.stat().st_size for f in files if f.suffix == ".safetensors") or \
            sum(f.stat().st_size for f in files if f.suffix == ".bin")  # (a hub snapshot may
        # hold both: the loader takes the safetensors)
    except OSError:  # (unreadable: its load says why)
        weights = 0
    if not weights:
        return
    checkpoint = 3 * weights * 4 // _bytes_per_weight(start) \
        if cfg.save_every and not cfg.lora_rank else 0
    freed = sum(_size(p) for p in _doomed(out, cfg.keep_superseded, reads, coming=moving))
    free = shutil.disk_usage(out).free + freed
    if free >= weights + checkpoint:
        return
    what = f"{_gb(weights)} for its model" + (f", {_gb(checkpoint)} for a checkpoint"
                                              if checkpoint else "")
    kept, keep = _size(out / "superseded") - freed, cfg.keep_superseded
    fewer = (", or pass --keep-superseded 1: 0 keeps all" if not keep else
             f", or pass --keep-superseded {keep - 1}" if keep > 1 else "")  # (1: the fewest)
    hint = (f"; {out / 'superseded'} holds {_gb(kept)} of earlier runs (delete what you no "
            f"longer need there{fewer})" if kept > 0 else "")
    raise SystemExit(f"error: --out {out}: {_gb(free)} free on its disk"
                     f"{' once superseded/ is pruned' if freed else ''}, and this run writes "
                     f"{_gb(weights + checkpoint)} ({what}); make room, or choose another --out"
                     f"{hint} (nothing was changed)")


def room_left(out: Path) -> str:
    """What a write into --out may take, in words: the free space on its disk, and this
    process's file-size limit (ulimit -f) where it has one."""
    try:
        said = f"its disk has {_gb(shutil.disk_usage(out).free)} free"
    except OSError:
        said = "its disk's free space is unknown"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        said += f", and this process may write files of at most {_gb(limit)} (ulimit -f)"
    return said


def _start_folder(cfg) -> Path | None:
    """The local folder the run's weights start from (a run folder stands for its model/),
    without converting or downloading anything; None where there is none yet."""
    name = getattr(cfg, "init_from", "") or cfg.model
    path = default_model_folder() if name == DEFAULT_MODEL else Path(name)
    if not (path / "config.json").exists() and (path / "model" / "config.json").exists():
        path = path / "model"
    return path if path.is_dir() else None


def _bytes_per_weight(folder: Path) -> int:
    """2 for a model its config says is in bf16 or fp16, else 4."""
    try:
        config = json.loads((folder / "config.json").read_text())
        dtype = config.get("dtype") or config.get("torch_dtype")
    except (OSError, ValueError, AttributeError):
        return 4
    return 2 if dtype in ("bfloat16", "float16") else 4


def _size(path: Path) -> int:
    """Bytes of the files under `path` (links not followed)."""
    if _kind(path) != "a folder":
        return 0
    return sum(os.lstat(os.path.join(root, name)).st_size
               for root, _, names in os.walk(path) for name in names)


def _gb(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
