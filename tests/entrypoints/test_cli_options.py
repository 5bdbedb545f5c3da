"""The command line a vLLM user types: --version, the model named first, prefix caching on and
off, sizes with units, and every option's default in --help.

Oracles: the installed distribution's metadata, the store URLs' own size parser fed the
same sizes as plain byte counts, and the parsers' own actions (each must show its default)."""
from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys

import pytest

from prefixserve.engine.config import EngineConfig, parse_size
from prefixserve.entrypoints.cli import build_parser
from prefixserve.entrypoints.engine_args import engine_config_from_args, model_from_args

ENGINE_COMMANDS = ("serve", "generate", "demo")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefixserve", *args], capture_output=True, text=True,
                          timeout=120)


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_version_prints_the_installed_version_and_exits_0():
    proc = cli("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["prefixserve", importlib.metadata.version("prefixserve")]


@pytest.mark.parametrize("argv, model", [
    (["serve"], "random:qwen3-tiny"),
    (["serve", "random:qwen3-0.6b"], "random:qwen3-0.6b"),
    (["serve", "--model", "random:qwen3-0.6b"], "random:qwen3-0.6b"),
    (["serve", "random:qwen3-0.6b", "--model", "random:qwen3-0.6b"], "random:qwen3-0.6b"),
    (["serve", "--port", "9000", "/models/qwen3", "--dtype", "float32"], "/models/qwen3"),
    (["demo"], "random:qwen3-0.6b"),
])
def test_the_model_comes_from_the_positional_or_the_flag(argv, model):
    args = parse(*argv)
    assert model_from_args(args) == model
    assert engine_config_from_args(args).model == model


def test_two_different_models_are_an_error_naming_both():
    proc = cli("serve", "random:qwen3-0.6b", "--model", "random:qwen3-tiny")
    assert proc.returncode == 2
    assert "'random:qwen3-0.6b'" in proc.stderr and "'random:qwen3-tiny'" in proc.stderr


@pytest.mark.parametrize("flags, enabled", [
    ([], EngineConfig().enable_prefix_caching),
    (["--enable-prefix-caching"], True),
    (["--no-enable-prefix-caching"], False),
    (["--no-prefix-caching"], False),
    (["--no-enable-prefix-caching", "--enable-prefix-caching"], True),
])
@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_prefix_caching_switches(command, flags, enabled):
    prompt = ["hi"] if command == "generate" else []
    assert engine_config_from_args(parse(command, *prompt, *flags)).enable_prefix_caching is enabled


SIZES = ["4GiB", "512MiB", "1.5GB", "64KiB", "12345", "1 MiB"]


@pytest.mark.parametrize("text", SIZES)
@pytest.mark.parametrize("flag, dest", [("--kv-cache-memory", "kv_cache_memory"),
                                        ("--max-body-bytes", "max_body_bytes"),
                                        ("--offload-body-bytes", "offload_body_bytes")])
def test_every_size_option_takes_units_and_agrees_with_plain_bytes(flag, dest, text):
    with_unit = getattr(parse("serve", flag, text), dest)
    assert with_unit == parse_size(text)
    assert getattr(parse("serve", flag, str(with_unit)), dest) == with_unit


def test_kv_cache_memory_reaches_the_engine_config():
    assert engine_config_from_args(parse("generate", "hi", "--kv-cache-memory", "2GiB")).kv_cache_memory == 2**31


@pytest.mark.parametrize("text", ["4XB", "GiB", "-1MiB", "0", "four"])
def test_a_bad_size_is_an_argparse_error_naming_the_option(text):
    proc = cli("serve", f"--kv-cache-memory={text}")
    assert proc.returncode == 2
    assert "argument --kv-cache-memory" in proc.stderr and repr(text) in proc.stderr


def option_blocks(help_text: str) -> dict[str, str]:
    """Each option's entry of a --help text, keyed by its first option string."""
    blocks: dict[str, str] = {}
    current = None
    for line in help_text.splitlines():
        m = re.match(r"  (-{1,2}[\w-]+)", line)
        if m:
            current = m.group(1)
            blocks[current] = line
        elif current is not None and line.startswith(" " * 4):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return blocks


@pytest.mark.parametrize("command", [*ENGINE_COMMANDS, "kv-store"])
def test_help_shows_every_options_default(command):
    sub = build_parser()._subparsers._group_actions[0].choices[command]
    help_text = sub.format_help()
    blocks = option_blocks(help_text)
    shown = {a.option_strings[0] for a in sub._actions
             if a.option_strings and a.help != "==SUPPRESS==" and a.dest != "help"}
    assert shown <= set(blocks), shown - set(blocks)
    assert [o for o in sorted(shown) if "default" not in blocks[o].lower()] == []
    for option in ("--host", "--port", "--block-size", "--max-num-seqs"):
        if option in shown:
            action = next(a for a in sub._actions if option in a.option_strings)
            assert f"(default: {action.default})" in blocks[option]


def test_serve_help_lists_the_vllm_spellings():
    out = cli("serve", "--help").stdout
    assert "MODEL" in out and "--enable-prefix-caching, --no-enable-prefix-caching" in out
    assert "(default: 127.0.0.1)" in out and "(default: 8000)" in out
