"""Running a model's code: the `python` tool, in a process that cannot hang the run, read its
secrets, reach the network, or change anything outside a scratch folder of its own.

    run_python(code) -> ToolResult(output, error, seconds)

Each call is a fresh `python -I` process in a new, empty scratch folder (deleted after), in a
process group of its own, with:
- a wall-time limit: the whole group is killed when it runs out (an infinite loop, a sleeping child);
- CPU, memory, file-size and process-count limits (setrlimit): a CPU hog, a memory bomb, 1 GB of
  output (its output goes to a file in the scratch folder, capped by the file-size limit) all end;
- an environment of PATH, HOME (the scratch folder) and LANG only: no tokens, keys or credentials;
- an audit hook (PEP 578; it cannot be removed from Python code) installed before the model's code
  runs, refusing: opening a file outside the scratch folder (for reading too), creating, renaming
  or deleting outside it, sockets, starting processes (fork, exec, subprocess, os.system), ctypes
  and loading native libraries, and changing limits.

What this does NOT protect against (it is not a container): a bug in CPython or a C extension
that bypasses audit hooks, a kernel exploit, timing side channels, reading the interpreter's own
files and the Python standard library (the process must import them), and reading what the
current user may read through a path the hook does not see (e.g. an already-open descriptor -- the
process inherits none but its standard streams). For untrusted models on shared machines, run the
whole trainer in a container or VM.
"""

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

TIMEOUT = 5.0  # wall seconds per call
CPU_SECONDS = 5  # CPU seconds per call (RLIMIT_CPU)
MEMORY = 1 << 30  # bytes of address space (RLIMIT_AS)
OUTPUT = 1 << 16  # bytes of output kept (RLIMIT_FSIZE kills a process that writes more)
PROCESSES = 64  # RLIMIT_NPROC: a fork bomb that got past the audit hook stops here (not root)

# Runs first in the child, before the model's code: the audit hook -- a closure, so that nothing
# the model's code can name reaches its state -- then that code, read from stdin.
_PRELUDE = r'''
def _install():
    import os, sys
    root = os.path.realpath(os.getcwd()) + os.sep
    stdlib = tuple(os.path.realpath(p) + os.sep for p in sys.path if p)
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    paths = ("os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.chmod", "os.chown", "os.link",
             "os.symlink", "os.truncate", "os.utime", "os.listdir", "os.scandir", "os.chdir",
             "shutil.rmtree", "shutil.copyfile", "shutil.move")
    banned = ("socket.", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn",
              "os.system", "subprocess.", "ctypes.", "resource.setrlimit", "os.kill", "os.putenv",
              "os.unsetenv", "signal.", "sys._getframe", "sys._current_frames", "sys.settrace",
              "sys.setprofile", "gc.", "cpython.")
    modules = ("socket", "_socket", "ctypes", "_ctypes", "multiprocessing", "subprocess", "mmap",
               "_posixsubprocess", "gc", "_xxsubinterpreters", "_testcapi", "_testinternalcapi")

    def inside(path):
        if isinstance(path, int):
            return path <= 2  # stdin, stdout, stderr only
        return os.path.realpath(os.fsdecode(path)).startswith(root)

    def guard(event, args):
        if event == "open":
            path, mode, flags = args
            if inside(path):
                return
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                (isinstance(flags, int) and flags & writes)
            if not writing and os.path.realpath(os.fsdecode(path)).startswith(stdlib):
                return  # the standard library, for imports
            raise PermissionError(f"sandbox: no access to {os.fsdecode(path)!r} outside the "
                                  f"scratch folder")
        if event in paths:
            if all(inside(a) for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))):
                return
            raise PermissionError(f"sandbox: {event} outside the scratch folder")
        if event.startswith(banned):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0].split(".")[0] in modules:
            raise PermissionError(f"sandbox: import {args[0]} is not allowed")

    sys.addaudithook(guard)
    return sys.stdin.read()

_code = _install()
del _install
exec(compile(_code, "<tool call>", "exec"), {"__name__": "__main__"})
'''


@dataclass
class ToolResult:
    output: str  # what the code printed (stdout and stderr), capped
    error: str  # why the call failed ("" when it did not)
    seconds: float


def run_python(code: str, timeout: float = TIMEOUT) -> ToolResult:
    """Run `code` in a sandboxed process (see the module docstring); never raises for what the
    code does: a failure is a ToolResult with an error, which becomes the model's observation."""
    t0 = time.perf_counter()
    scratch = tempfile.mkdtemp(prefix="smolrl-tool-")
    out_path = os.path.join(scratch, ".output")
    try:
        with open(out_path, "wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _PRELUDE], stdin=subprocess.PIPE, stdout=out,
                stderr=subprocess.STDOUT, cwd=scratch, start_new_session=True,
                env={"PATH": "/usr/bin:/bin", "HOME": scratch, "LANG": "C.UTF-8"},
                preexec_fn=_limits)
            try:
                process.communicate(code.encode(), timeout=timeout)
                error = _exit_reason(process.returncode)
            except subprocess.TimeoutExpired:
                error = f"timed out after {timeout:g} s"
            finally:
                _kill_group(process)
        with open(out_path, "rb") as f:
            output = f.read(OUTPUT).decode("utf-8", "replace")
        if os.path.getsize(out_path) >= OUTPUT:  # (Python ignores SIGXFSZ: its write fails)
            error = f"output over {OUTPUT} bytes"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if not error and "Traceback (most recent call last)" in output:
        error = output.strip().splitlines()[-1][:200]
    return ToolResult(output.strip(), error, time.perf_counter() - t0)


def _limits():
    """In the child, before Python starts: the resource limits (they hold for its children)."""
    for limit, value in ((resource.RLIMIT_AS, MEMORY), (resource.RLIMIT_FSIZE, OUTPUT),
                         (resource.RLIMIT_NPROC, PROCESSES), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, (value, value))
    # Linux sends SIGXCPU at the soft CPU limit and SIGKILL at the hard one: a second between them
    # lets the child die of SIGXCPU, so the model is told it hit the CPU limit.
    resource.setrlimit(resource.RLIMIT_CPU, (CPU_SECONDS, CPU_SECONDS + 1))


def _kill_group(process):
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the child and anything it started
    except ProcessLookupError:
        pass
    process.wait()


def _exit_reason(code: int) -> str:
    if code == 0 or code == 1:  # 1: an exception, whose traceback is in the output
        return ""
    signals = {-signal.SIGKILL: "killed (memory or process limit)",
               -signal.SIGXCPU: f"CPU limit of {CPU_SECONDS} s reached",
               -signal.SIGXFSZ: f"output over {OUTPUT} bytes", -signal.SIGSEGV: "crashed"}
    return signals.get(code, f"exited with code {code}")
