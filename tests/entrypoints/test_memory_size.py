"""Memory options as a share of the device: `--kv-cache-memory 0.5` or `50%` of the memory free
at start, on every command that builds an engine.

Oracles: the host's physical memory from sysconf (a share can never exceed it, and a share of
free memory is a share of at most that), the same share written both ways, and the byte
spellings' own parser."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from prefixserve.engine.config import parse_size
from prefixserve.entrypoints.cli import build_parser
from prefixserve.entrypoints.engine_args import engine_config_from_args
from prefixserve.entrypoints.memory_size import DeviceShare, free_device_memory, memory_size

PHYSICAL = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("text, fraction", [("0.5", 0.5), ("50%", 0.5), (".25", 0.25), ("25 %", 0.25),
                                            ("1.0", 1.0), ("100%", 1.0), ("12.5%", 0.125), ("0.05", 0.05)])
def test_a_share_is_read_both_ways(text, fraction):
    assert memory_size(text) == DeviceShare(fraction)


@pytest.mark.parametrize("text", ["4GiB", "512MiB", "1.5GB", "12345", "1"])
def test_sizes_stay_bytes(text):
    assert memory_size(text) == parse_size(text)


@pytest.mark.parametrize("command", ["serve", "generate", "demo"])
@pytest.mark.parametrize("text, fraction", [("0.25", 0.25), ("25%", 0.25)])
def test_a_share_becomes_that_share_of_free_host_memory(command, text, fraction):
    prompt = ["hi"] if command == "generate" else []
    before = free_device_memory("cpu")
    size = engine_config_from_args(parse(command, *prompt, "--kv-cache-memory", text)).kv_cache_memory
    after = free_device_memory("cpu")
    assert isinstance(size, int)
    assert 0 < size <= fraction * PHYSICAL
    # free memory moves while the test runs: the share is of a value seen between the two reads
    assert int(fraction * min(before, after)) * 0.9 <= size <= int(fraction * max(before, after)) * 1.1


def test_free_host_memory_is_within_the_physical_memory():
    assert 0 < free_device_memory("cpu") <= PHYSICAL


def test_a_share_on_a_device_without_a_memory_query_is_an_error_naming_the_option():
    proc = subprocess.run([sys.executable, "-m", "prefixserve", "generate", "hi", "--device", "mps",
                           "--kv-cache-memory", "50%"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "'mps'" in proc.stderr and "4GiB" in proc.stderr


@pytest.mark.parametrize("text", ["0", "0%", "0.0", "150%", "1.5", "-0.5", "-50%", "50%%", "%", "0.5GiB%"])
def test_a_bad_share_is_an_argparse_error_naming_the_option(text, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse("serve", f"--kv-cache-memory={text}")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --kv-cache-memory" in err and repr(text) in err


def test_help_names_the_share():
    help_text = " ".join(parse_help("serve").split())
    assert "0.5 or 50%" in help_text and "mem_get_info" in help_text


def parse_help(command: str) -> str:
    return build_parser()._subparsers._group_actions[0].choices[command].format_help()


def test_on_cuda_the_share_is_of_the_drivers_free_memory_on_that_gpu(monkeypatch):
    """No GPU here: torch.cuda.mem_get_info stands in for the driver, and the test checks that the
    share is asked of the GPU named (its index kept) and taken of its free bytes, not its total."""
    import torch

    asked = []

    def mem_get_info(device):
        asked.append(device)
        return 6 * 2**30, 80 * 2**30

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    config = engine_config_from_args(parse("serve", "--device", "cuda:1", "--kv-cache-memory", "50%"))
    assert config.kv_cache_memory == 3 * 2**30
    assert asked == [torch.device("cuda:1")]
