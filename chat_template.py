"""A model's chat template, tried under a time and memory bound before it renders a prompt.

A chat template is a Jinja program that comes with the model -- its folder's chat_template.jinja
or tokenizer_config.json, a hub download: input smolrl did not write. transformers renders it in
Jinja's sandbox, which keeps it from Python's internals (it runs no code of its own) but bounds
neither its time nor its memory: two nested loops over range(100000) took ~18 CPU-minutes a
prompt, and a string doubled 28 times held 268M characters (+400 MB) -- every prompt of a run.

So, when a tokenizer loads (model.load_tokenizer), before any prompt is rendered:

    check_template_files(folder)              # a template file past any template's size: unread
    check_chat_template(tokenizer, folder)    # each template once a process: its first renders

Either returns, or stops the run with one line naming the file. check_chat_template renders
stand_ins() -- conversations of the shapes smolrl renders: a user's question with the assistant's
turn to come, a system prompt and several turns, a tool call with its result and the tools'
schemas -- with each template (of several: each named one too) in a child process of its own
(fork: no interpreter to start, the tokenizer already in it) that has TEMPLATE_SECONDS of wall-clock time and TEMPLATE_MEMORY bytes of address space more than it
was born with; each rendering must be at most MAX_RENDER_CHARS long (the stand-ins hold up to
~2,300 characters; a real template adds a few hundred). A template that does not compile, or is
longer than MAX_TEMPLATE_CHARS, stops the run too. One that refuses a stand-in (raise_exception:
"System role not supported") passes: that is its own rule, met or not by the real conversation;
one that raises on every stand-in, the plain question included, renders no prompt and stops.

What this does not bound: the renders after it, in the trainer's own process, of the run's
prompts and episodes. A template keeps nothing from one render to the next (the sandbox lets it
change no object it is given), so the same conversation costs the same every time -- except
through the two things it can see change: the clock (strftime_now, with which Llama 3's template
writes the date) and Jinja's `random` filter. And its cost may grow with what it is given: the
length of a message, the turns of a long episode, a word it looks for. A template written to
blow up on such input, at such a time, or on one render in a hundred, passes these renders and
still can; that is an attack, not a template -- read the file of a model you do not trust.
"""

import json
import os
import select
import signal
import time
from pathlib import Path

TEMPLATE_SECONDS = 10.0  # a template, for all the stand-ins (a real one: milliseconds)
TEMPLATE_MEMORY = 512 * 2**20  # bytes of address space the renders may add
MAX_RENDER_CHARS = 100_000  # a stand-in rendered
MAX_TEMPLATE_CHARS = 1_000_000  # the template itself (real ones: a few thousand)

_QUESTION = "What is 12 + 34? Think it through, then reply with the number. " * 12  # ~750 chars


def _tool_schema() -> dict:
    return {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "required": ["expression"], "properties": {
            "expression": {"type": "string", "description": "e.g. 2 + 3"}}}}}


def stand_ins() -> list[tuple[list[dict], dict]]:
    """(messages, apply_chat_template's arguments) of each stand-in conversation."""
    user = {"role": "user", "content": _QUESTION}
    call = {"type": "function", "function": {"name": "calculator",
                                             "arguments": {"expression": "12 + 34"}}}
    return [
        ([user], {"add_generation_prompt": True}),
        ([{"role": "system", "content": "You are a careful assistant."}, user,
          {"role": "assistant", "content": "The answer is 46."}, user,
          {"role": "assistant", "content": "The answer is 46."}, user],
         {"add_generation_prompt": True}),
        ([user, {"role": "assistant", "content": "", "tool_calls": [call]},
          {"role": "tool", "name": "calculator", "content": "46"}],
         {"add_generation_prompt": True, "tools": [_tool_schema()]}),
    ]


_checked: set[str] = set()  # the templates that passed in this process


def check_template_files(folder: str):
    """Before a tokenizer loads: a template file of its own (chat_template.jinja, .json, or one of
    additional_chat_templates/) longer than any template could be stops the run, unread."""
    folder = Path(folder)
    files = [folder / "chat_template.jinja", folder / "chat_template.json",
             *sorted(folder.glob("additional_chat_templates/*.jinja"))]
    most = 4 * MAX_TEMPLATE_CHARS  # bytes (UTF-8: at most 4 a character)
    for file in files:
        if file.is_file() and file.stat().st_size > most:
            raise SystemExit(f"error: {file}: {file.stat().st_size:,} bytes, more than any chat "
                             f"template smolrl renders ({MAX_TEMPLATE_CHARS:,} characters; a "
                             f"real one is a few thousand)")


def check_chat_template(tokenizer, folder: str):
    """Return if the tokenizer's chat template (each, where it has several) renders the stand-ins
    within the bounds; else stop with one line naming the file it came from (template_file) --
    and, of several, the template."""
    template = tokenizer.chat_template
    if not template:
        return
    named = template if isinstance(template, dict) else {"default": template}
    key = json.dumps(list(named.values()))
    if key in _checked:
        return
    for name, text in named.items():  # (each in a child of its own: the one that fails is named)
        what = "its chat template" + (f" {name!r}" if len(named) > 1 else "")
        if len(text) > MAX_TEMPLATE_CHARS:
            raise SystemExit(f"error: {template_file(folder, name)}: {what} is {len(text):,} "
                             f"characters long, more than the {MAX_TEMPLATE_CHARS:,} smolrl "
                             f"renders (a real one is a few thousand)")
        why = _render_in_child(tokenizer, [text])
        if why:
            raise SystemExit(f"error: {template_file(folder, name)}: {what} {why}; fix the "
                             f"template there, or use a model whose template is plain")
    _checked.add(key)


def template_file(folder: str, name: str = "default") -> str:
    """The file a folder's chat template `name` came from, as transformers reads it (a named one
    from additional_chat_templates/, the default from chat_template.jinja first); a hub id's, in
    words."""
    names = ["chat_template.jinja", "chat_template.json", "tokenizer_config.json"]
    if name != "default":
        names.insert(0, f"additional_chat_templates/{name}.jinja")
    for file in names:
        if (Path(folder) / file).is_file():
            return str(Path(folder) / file)
    return f"{folder} (its chat_template.jinja or tokenizer_config.json)"


def _render_in_child(tokenizer, templates: list[str]) -> str | None:
    """What went wrong rendering every stand-in with each template in a forked child, or None.
    The child writes one JSON value to a pipe and exits; past the deadline it is killed."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        try:
            os.close(read)
            _quiet_and_bounded()
            os.write(write, json.dumps(_render_all(tokenizer, templates)).encode())
        finally:
            os._exit(0)
    os.close(write)
    deadline, out, ended = time.monotonic() + TEMPLATE_SECONDS, b"", False
    try:
        while select.select([read], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(read, 65536)
            if not chunk:  # the child has exited
                ended = True
                break
            out += chunk
    finally:
        os.close(read)
        try:
            if not ended:
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ChildProcessError, ProcessLookupError):  # (SIGCHLD ignored: the kernel reaped it)
            pass
    if not ended:
        return (f"took more than {TEMPLATE_SECONDS:g} s to render a short conversation "
                f"(stopped there)")
    if not out:  # (killed, or an allocation failed where Python could not say so)
        return (f"crashed rendering a short conversation (in at most "
                f"{TEMPLATE_MEMORY // 2**20} MiB more memory)")
    return json.loads(out)


def _quiet_and_bounded():
    """The child's output goes nowhere (transformers' warnings would repeat the parent's), and
    its address space may grow by TEMPLATE_MEMORY at most: past it an allocation fails. (Where
    /proc does not say its size, not Linux, the time and size bounds alone hold.)"""
    import resource
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    try:
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration):
        return
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]  # (a `ulimit -v` of the user's: kept)
    most = size + TEMPLATE_MEMORY if hard == resource.RLIM_INFINITY else \
        min(size + TEMPLATE_MEMORY, hard)
    resource.setrlimit(resource.RLIMIT_AS, (most, most))


def _render_all(tokenizer, templates: list[str]) -> str | None:
    """In the child: what went wrong with the first template and stand-in that failed, or None."""
    from jinja2 import TemplateSyntaxError
    for template in templates:
        refusals = []
        for messages, kwargs in stand_ins():
            try:
                text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                     chat_template=template, **kwargs)
            except TemplateSyntaxError as e:
                return f"does not compile (line {e.lineno}: {e.message})"
            except MemoryError:
                return (f"took more than {TEMPLATE_MEMORY // 2**20} MiB to render a short "
                        f"conversation")
            except Exception as e:  # (its own refusal of this conversation: see the docstring)
                refusals.append(f"{type(e).__name__}: {str(e)[:200]}")
                continue
            if len(text) > MAX_RENDER_CHARS:
                given = sum(len(m["content"]) for m in messages)
                return (f"rendered a short conversation ({given:,} characters) as {len(text):,} "
                        f"characters, more than {MAX_RENDER_CHARS:,}")
        if len(refusals) == len(stand_ins()):  # (the plain question too: it renders no prompt)
            why = "".join(c if c.isprintable() else repr(c)[1:-1] for c in refusals[0])
            return f"raises on every conversation smolrl renders ({why})"  # (data.escaped's way)
    return None
