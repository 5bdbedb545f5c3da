"""`prefixserve lint` exit codes and formats, `prefixserve replay` table and plot, and the
agent-log generator."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from prefixserve.entrypoints.cli import main
from diagnose_logs import RULE_LOGS, clean_log, write_log

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def logs(tmp_path):
    return {"clean": write_log(tmp_path / "clean.jsonl", clean_log()),
            "tools": write_log(tmp_path / "tools.jsonl", RULE_LOGS["tool-order"]())}


@pytest.mark.parametrize("log, fail_on, code", [
    ("clean", "all", 0),
    ("tools", "", 0),
    ("tools", "tool-order", 1),
    ("tools", "dynamic-system,whitespace-drift", 0),
    ("tools", "all", 1),
    ("tools", "no-such-rule", 2),
])
def test_lint_exit_codes(logs, capsys, log, fail_on, code):
    assert main(["lint", str(logs[log]), "--fail-on", fail_on]) == code


def test_lint_formats(logs, capsys):
    assert main(["lint", str(logs["tools"]), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["summary"]["rules_fired"] == ["tool-order"]
    assert data["rules"][0]["rule"] == "tool-order" and data["rules"][0]["fix"]
    assert len(data["requests"]) == 3 and data["requests"][1]["divergence"]["part"] == "tools"
    assert main(["lint", str(logs["tools"]), "--format", "markdown"]) == 0
    assert "### `tool-order`" in capsys.readouterr().out
    assert main(["lint", str(logs["tools"])]) == 0
    text = capsys.readouterr().out
    assert "[tool-order]" in text and "fix:" in text and "after suggested fixes" in text


def test_lint_shows_no_salt_as_a_dash(tmp_path, capsys):
    """A log without tenants or salts: its requests' salt column says "-", not Python's None."""
    log = write_log(tmp_path / "unsalted.jsonl",
                    [{k: v for k, v in r.items() if k != "tenant"} for r in RULE_LOGS["tool-order"]()])
    assert main(["lint", str(log), "--format", "json"]) == 0
    assert [r["cache_salt"] for r in json.loads(capsys.readouterr().out)["requests"]] == [None] * 3
    assert main(["lint", str(log), "--format", "markdown"]) == 0
    markdown = capsys.readouterr().out
    assert len([line for line in markdown.splitlines() if line.startswith("| line") and " | - | " in line]) == 3
    assert main(["lint", str(log)]) == 0
    text = capsys.readouterr().out
    assert "Requests (cache salt, tokens" in text and "None" not in text and "None" not in markdown


def test_replay_table_and_plot(logs, tmp_path, capsys):
    plot = tmp_path / "img" / "replay.png"
    assert main(["replay", str(logs["clean"]), "--cache-blocks", "40", "400", "--block-size", "16", "32",
                 "--eviction", "lru", "lfu", "--plot", str(plot)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:2] == ["block", "size"] and len(lines) == 1 + 2 * 2 * 2
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["replay", str(logs["clean"]), "--plot", str(tmp_path / "x.jpg")]) == 2


def test_agent_log_generator_is_deterministic_and_realistic(tmp_path):
    outs = []
    for name in ("a.jsonl", "b.jsonl"):
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_agent_log.py"),
                        str(tmp_path / name), "--requests", "200", "--seed", "3"], check=True,
                       capture_output=True)
        outs.append((tmp_path / name).read_text())
    assert outs[0] == outs[1]
    records = [json.loads(line) for line in outs[0].splitlines()]
    assert len(records) == 200
    assert len({r["tenant"] for r in records}) >= 5
    assert any("tools" in r["body"] for r in records)
    assert any(m.get("tool_calls") for r in records for m in r["body"].get("messages", []))
    assert max(len(r["body"].get("messages", [])) for r in records) >= 6


def test_lint_on_the_generated_agent_log_finds_every_pattern(tmp_path):
    from prefixserve.diagnose import lint, load_renderer, read_log
    from prefixserve.diagnose.rules import RULE_IDS
    path = tmp_path / "agent.jsonl"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_agent_log.py"), str(path)],
                   check=True, capture_output=True)
    report = lint(read_log(path), load_renderer("random:qwen3-tiny"))
    # every rule but changed-image: a text model's log has no pictures
    assert sorted(report.fired()) == sorted(set(RULE_IDS) - {"changed-image"})
    assert report.fixed_hit_rate > report.hit_rate
    # The control tenant follows the guide: no rule fires on it.
    assert not [f for r in report.requests if r.cache_salt == "wayne" for f in r.findings]


@pytest.mark.parametrize("command", ["lint", "replay"])
def test_a_log_of_another_model_is_warned_about(tmp_path, capsys, command):
    conversation = [{"role": "user", "content": "Where is my invoice?"}]
    other = write_log(tmp_path / "other.jsonl", [
        {"body": {"model": name, "messages": conversation}}
        for name in ("gpt-4o-mini", "Qwen/Qwen3-8B", "gpt-4o-mini")])
    same = write_log(tmp_path / "same.jsonl", [{"body": {"model": "random:qwen3-tiny", "messages": conversation}}])
    assert main([command, str(other), "--model", "random:qwen3-tiny"]) == 0
    err = capsys.readouterr().err
    assert "'gpt-4o-mini' (2 requests)" in err and "'Qwen/Qwen3-8B' (1 requests)" in err
    assert "random:qwen3-tiny" in err
    assert main([command, str(same), "--model", "random:qwen3-tiny"]) == 0
    assert "warning" not in capsys.readouterr().err
