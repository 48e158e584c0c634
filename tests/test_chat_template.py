"""A model's chat template is tried under a time, memory and size bound when its tokenizer loads:
one that runs for minutes or grows without end stops the run with one line naming its file,
before any prompt is rendered (issue 67)."""

import copy
import json
import time

import pytest

import chat_template
from model import load_tokenizer

NESTED_LOOPS = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                "{% endfor %}")
PLAIN = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}<assistant> {% endif %}")


def doubled(times: int) -> str:
    """A template whose output is a character doubled `times` times (2^times characters)."""
    return ("{% set ns = namespace(s='x') %}{% for i in range(" + str(times) + ") %}"
            "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}")


def folder_with(tmp_path, tokenizer, template, in_config: bool = False):
    """A tokenizer folder whose chat template is `template`: in chat_template.jinja, as
    transformers saves it, or (in_config) in tokenizer_config.json, as older models have it."""
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = template
    folder = tmp_path / "tokenizer"
    tokenizer.save_pretrained(folder)
    if in_config:
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config["chat_template"] = template
        config_file.write_text(json.dumps(config))
        (folder / "chat_template.jinja").unlink()
    return str(folder)


def stops(folder) -> str:
    with pytest.raises(SystemExit) as stop:
        load_tokenizer(folder)
    return str(stop.value)


def test_a_template_that_loops_for_minutes_stops_at_load_naming_its_file(tokenizer, tmp_path,
                                                                         monkeypatch):
    """Two nested loops over range(100000): ~18 CPU-minutes a prompt. Stopped at the deadline."""
    monkeypatch.setattr(chat_template, "TEMPLATE_SECONDS", 1.0)
    folder = folder_with(tmp_path, tokenizer, NESTED_LOOPS)
    t0 = time.monotonic()
    line = stops(folder)
    assert time.monotonic() - t0 < 5
    assert line.startswith(f"error: {folder}/chat_template.jinja: its chat template took more "
                           f"than 1 s to render a short conversation"), line


def test_a_template_that_grows_a_string_stops_at_load(tokenizer, tmp_path, monkeypatch):
    """A string doubled: 2^26 characters are far past any real rendering's size; 2^27 (134M)
    past the child's memory (lowered here to 64 MiB) -- or, where the child finds that much of the
    heap it was forked with free (the limit counts address space added after the fork), past the
    size check once rendered. Either way one line at load; neither reaches the trainer's memory."""
    from conftest import peak_rss_growth
    folder = folder_with(tmp_path, tokenizer, doubled(26), in_config=True)
    growth, line = peak_rss_growth(lambda: stops(folder))
    assert line == (f"error: {folder}/tokenizer_config.json: its chat template rendered a short "
                    f"conversation (756 characters) as 67,108,864 characters, more than 100,000; "
                    f"fix the template there, or use a model whose template is plain"), line
    assert growth < 50 * 2**20, growth  # (the string was 64 MB, built in the child)
    monkeypatch.setattr(chat_template, "TEMPLATE_MEMORY", 64 * 2**20)
    growth, line = peak_rss_growth(lambda: stops(folder_with(tmp_path, tokenizer, doubled(27))))
    assert ("to render a short conversation" in line and "64 MiB" in line) or line.endswith(
        "as 134,217,728 characters, more than 100,000; fix the template there, or use a model "
        "whose template is plain"), line
    assert growth < 50 * 2**20, growth


def test_a_template_slow_only_on_several_turns_or_tools_is_caught_too(tokenizer, tmp_path,
                                                                      monkeypatch):
    """The stand-ins are the shapes smolrl renders: a conversation of several turns, a tool call
    and its result with the tools' schemas -- and every named template a tokenizer holds."""
    monkeypatch.setattr(chat_template, "TEMPLATE_SECONDS", 1.0)
    for template in ("{% if messages | length > 3 %}" + NESTED_LOOPS + "{% endif %}" + PLAIN,
                     "{% if tools %}" + NESTED_LOOPS + "{% endif %}" + PLAIN,
                     {"default": PLAIN, "tool_use": NESTED_LOOPS}):
        assert "took more than 1 s" in stops(folder_with(tmp_path, tokenizer, template))


def test_a_named_template_that_fails_is_named_with_its_own_file(tokenizer, tmp_path,
                                                                 monkeypatch):
    """Of a tokenizer's several templates, the one that fails is named, with its file: transformers
    saves the default in chat_template.jinja and the others in additional_chat_templates/ (the
    line named chat_template.jinja, whose template was plain: "fix the template there")."""
    monkeypatch.setattr(chat_template, "TEMPLATE_SECONDS", 1.0)
    folder = folder_with(tmp_path, tokenizer, {"default": PLAIN, "tool_use": NESTED_LOOPS})
    line = stops(folder)
    assert line.startswith(f"error: {folder}/additional_chat_templates/tool_use.jinja: its chat "
                           f"template 'tool_use' took more than 1 s"), line


def test_a_template_that_does_not_compile_or_is_huge_stops_at_load(tokenizer, tmp_path):
    line = stops(folder_with(tmp_path, tokenizer, "{% for m in messages %}{{ m['content'] }}"))
    assert "its chat template does not compile (line 1: Unexpected end of template" in line, line
    line = stops(folder_with(tmp_path, tokenizer, "x" * 1_000_001, in_config=True))
    assert line.startswith("error: ") and line.endswith(
        "tokenizer_config.json: its chat template is 1,000,001 characters long, more than the "
        "1,000,000 smolrl renders (a real one is a few thousand)"), line
    # A template file of its own past any template's size is not even read
    folder = folder_with(tmp_path, tokenizer, PLAIN)
    with open(f"{folder}/chat_template.jinja", "a") as f:
        f.truncate(4_000_001)  # (a sparse file: 4 MB of zeros that take no disk)
    assert stops(folder) == (f"error: {folder}/chat_template.jinja: 4,000,001 bytes, more than "
                             f"any chat template smolrl renders (1,000,000 characters; a real "
                             f"one is a few thousand)")


def test_plain_templates_and_ones_that_refuse_a_shape_load_and_render(tokenizer, tmp_path):
    """SmolLM2's own template, and one that refuses a system prompt (as Gemma's does): they load,
    checked once a process, and render as before."""
    refuses = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
               "supported') }}{% endif %}" + PLAIN)
    for template in (tokenizer.chat_template, refuses):
        folder = folder_with(tmp_path, tokenizer, template)
        t0 = time.monotonic()
        loaded = load_tokenizer(folder)
        assert time.monotonic() - t0 < 5
        messages = [{"role": "user", "content": "Hi"}]
        assert loaded.apply_chat_template(messages, tokenize=False) == \
            tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template)
        assert json.dumps([template]) in chat_template._checked


def test_a_plain_template_loads_where_sigchld_is_ignored(tokenizer, tmp_path):
    """A process that inherits SIGCHLD ignored (a launcher's, kept across exec) has its children
    reaped by the kernel: waiting for the child raised ChildProcessError, a traceback at load."""
    import signal
    folder = folder_with(tmp_path, tokenizer, PLAIN + " ")  # (not yet checked in this process)
    before = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        load_tokenizer(folder)
    finally:
        signal.signal(signal.SIGCHLD, before)


def test_a_template_that_raises_on_every_conversation_stops_in_one_line(tokenizer, tmp_path):
    """A template may refuse a conversation of a shape it does not take (a system prompt), but
    one that raises on every stand-in -- the plain question included -- can render no prompt of
    the run: one line naming the file and its error, not a traceback at the first prompt."""
    for template, why in (("{{ raise_exception('no \x1b]52;c;eA==\x07 prompts') }}",
                           "TemplateError: no \\x1b]52;c;eA==\\x07 prompts"),
                          ("{{ 'x' * 10**30 }}" + PLAIN, "OverflowError")):
        folder = folder_with(tmp_path, tokenizer, template)
        line = stops(folder)
        assert line.startswith(f"error: {folder}/chat_template.jinja: its chat template raises on "
                               f"every conversation smolrl renders"), line
        assert why in line and line.isprintable(), line
