"""A run asked to stop: SIGTERM -- a scheduler preempting the job (SLURM, Kubernetes, a spot
instance's notice), which sends SIGKILL a grace period later, often 30 s -- and SIGINT (Ctrl-C).

    catch_stop_signals(grace, give_up)   session.start_log: from the run's first write on
    ... a step ...
    signum = asked()                     session.after_step, when a step has ended: if a signal
                                         came, that step's checkpoint, one line, exit 128 + signum
    release_stop_signals()               the run's end: the handlers before it back

The first signal only sets a flag and says so in one line; the run looks at it when its step has
ended. The step under way is finished, not abandoned: a step's state -- weights, optimizer, data
position, every RNG -- is whole only at its end, so a checkpoint of it resumes exactly. A step
that has not ended, and been checkpointed, `grace` seconds after the signal (--stop-grace) is
given up: give_up(signum) says which checkpoint is whole and exits, before the scheduler's
SIGKILL cuts the run off in silence. The first signal also hands both signals back to the
kernel's default action: a second one ends the process at once, wherever it is (a checkpoint half
written stays a `.tmp-` folder, which --resume never takes).

A run that stops with an error inside a process that goes on (a notebook, the tests) hands them
back as well (session.one_run, around each algorithm's main), its grace timer stopped.

Under Ray only the driver catches them. Ctrl-C reaches the terminal's process group: the driver
and the local Ray's own processes, which block SIGINT; the workers have process groups of their
own. The driver finishes the step and has the trainers write their half of the checkpoint.
"""

import os
import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)

_state = {"signum": 0, "grace": 0.0, "give_up": None, "timer": None, "before": {}}


def asked() -> int:
    """The signal that asked the run to stop (0: none has)."""
    return _state["signum"]


def catch_stop_signals(grace: float, give_up):
    """From now until release_stop_signals, SIGTERM and SIGINT ask the run to stop after its step.
    give_up(signum) runs, in a thread of its own, when the step has not ended `grace` seconds
    after the signal (0: no limit); it must end the process. Only the main thread can set
    handlers: a run started in another one (a notebook's worker thread) stops as it always did."""
    if threading.current_thread() is not threading.main_thread():
        return
    release_stop_signals()  # (a run before this one in the process that did not hand them back)
    _state.update(grace=grace, give_up=give_up)
    for signum in SIGNALS:
        _state["before"][signum] = signal.getsignal(signum)
        signal.signal(signum, _asked)


def _asked(signum, frame):
    for other in SIGNALS:  # a second signal: the kernel's default, at once, wherever the run is
        signal.signal(other, signal.SIG_DFL)
    _state["signum"] = signum
    # os.write, not print: a handler runs between two bytecodes of the main thread, which may be
    # inside a print to the same buffered stream
    os.write(2, f"\nstopping after this step (signal {signum}); a second signal exits at "
                f"once\n".encode())
    if 0 < _state["grace"] < threading.TIMEOUT_MAX / 2:  # (one past what a timer can wait,
        # --stop-grace inf: no limit, as 0 is)
        timer = threading.Timer(_state["grace"], _state["give_up"], (signum,))
        timer.daemon = True
        timer.start()
        _state["timer"] = timer


def release_stop_signals():
    """The handlers from before the run back, the grace's timer stopped: the run has ended, or is
    ending with its checkpoint written."""
    if _state["timer"] is not None:
        _state["timer"].cancel()
    for signum, handler in _state["before"].items():
        signal.signal(signum, handler)
    _state.update(signum=0, timer=None, before={})


def exit_now(signum: int, line: str):
    """give_up's end: `line` on stderr and the process gone, 128 + signum as a shell reports a
    process a signal ended (os._exit: the main thread is still inside the step)."""
    os.write(2, f"\n{line}\n".encode())
    os._exit(128 + signum)
