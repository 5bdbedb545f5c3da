"""Every snippet of README.md and docs/*.md runs as written, against random:qwen3-tiny, so a
snippet that drifts from the code fails here.

The conventions the documents follow:
- ```python blocks of one document run in order, in one namespace (a later block may use what an
  earlier one defined, as a reader would), each document in a fresh one.
- Shell blocks (```bash, ```sh, ```shell; in ```console only the `$ ` lines) run with bash in one
  working directory shared by every document (a checkout's scripts/ in it), `prefixserve` on
  PATH (a leading `.venv/bin/` is the same command). A command whose line ends in
  `# exit code N` must exit with N; every other command must succeed (the block runs under
  `set -e`).
- Snippets reach the server at `http://localhost:8000`, as a user would after
  `prefixserve serve random:qwen3-tiny`: the test starts one real server (the serve command's own
  options, with `--request-log requests.jsonl` in the working directory, so `lint` and
  `replay` find a log of what the snippets sent) and points that address at it. A `prefixserve
  serve ...` command is that start: it is not run again, but its options must parse.
- A block that must not run (a GPU, Ray, a download, an install) has `<!-- not-run: REASON -->` on
  the line right before its fence; its serve commands are still parsed. Output and examples are
  ```text or ```json and are not run.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
from live_server import LiveServer

from prefixserve.entrypoints.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELLS = ("bash", "sh", "shell", "console")
RUN = ("python", *SHELLS)
SERVER_ADDRESSES = ("localhost:8000", "127.0.0.1:8000")
SERVE_ARGV = ["serve", "random:qwen3-tiny", "--request-log", "requests.jsonl"]

_FENCE = re.compile(r"^(?P<indent> *)(?P<marker>`{3,}|~{3,})\s*(?P<lang>[^\s`]*)")
_NOT_RUN = re.compile(r"\s*<!--\s*not-run:(?P<reason>.*?)-->\s*")
_EXIT_CODE = re.compile(r"#\s*exit code (\d+)\s*$")
_HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")


@dataclass(frozen=True)
class Block:
    document: str
    line: int                   # of the opening fence, 1-based
    lang: str
    code: str
    not_run: Optional[str]      # the reason given, where the block is marked not to run

    @property
    def where(self) -> str:
        return f"{self.document}:{self.line}"


def blocks_of(text: str, document: str) -> list[Block]:
    """Every fenced block, in order, dedented by its fence's indent (fences inside list items)."""
    lines = text.splitlines()
    found, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, marker = len(m["indent"]), m["marker"]
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(marker):
            end += 1
        code = "\n".join(line[indent:] if not line[:indent].strip() else line.lstrip()
                         for line in lines[i + 1:end])
        marked = _NOT_RUN.fullmatch(lines[i - 1]) if i > 0 else None
        found.append(Block(document, i + 1, m["lang"].lower(), code + "\n",
                           marked["reason"].strip() if marked else None))
        i = end + 1
    return found


def documents() -> dict[str, list[Block]]:
    return {str(path.relative_to(ROOT)): blocks_of(path.read_text(), str(path.relative_to(ROOT)))
            for path in DOCUMENTS}


def shell_commands(block: Block) -> list[str]:
    """The block's commands, one logical line each: continuation lines and a quote left open
    across lines joined, a heredoc kept with its command, comment-only and blank lines
    dropped; in a console block only `$ ` lines."""
    lines = block.code.splitlines()
    if block.lang == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    commands, i = [], 0
    while i < len(lines):
        command = lines[i]
        while command.endswith("\\") and i + 1 < len(lines):
            i += 1
            command = command[:-1] + " " + lines[i].strip()
        while not _quotes_closed(command) and i + 1 < len(lines):
            i += 1
            command += "\n" + lines[i]
        heredoc = _HEREDOC.search(command.split("#")[0])
        if heredoc:
            while i + 1 < len(lines):
                i += 1
                command += "\n" + lines[i]
                if lines[i].strip() == heredoc[1]:
                    break
        i += 1
        if command.strip() and not command.lstrip().startswith("#"):
            commands.append(command.replace(".venv/bin/", ""))
    return commands


def _quotes_closed(command: str) -> bool:
    """False while a quoted argument (a JSON body, say) runs on to the next line."""
    try:
        shlex.split(command, comments=True)
    except ValueError:
        return False
    return True


def serve_argv(command: str) -> Optional[list[str]]:
    """The argv after `prefixserve` where the command starts the server, else None."""
    if "\n" in command:
        return None
    words = shlex.split(command, comments=True)
    if words and words[-1] == "&":
        words = words[:-1]
    for head in (["prefixserve"], ["python", "-m", "prefixserve"], ["python3", "-m", "prefixserve"]):
        if words[:len(head)] == head and words[len(head):len(head) + 1] == ["serve"]:
            return words[len(head):]
    return None


def serve_options_error(argv: list[str]) -> Optional[str]:
    """What the real parser says about a serve command's options, None when they parse."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            build_parser().parse_args(argv)
    except SystemExit as exc:
        return stderr.getvalue() or f"exit {exc.code}"
    return None


def shell_script(block: Block) -> tuple[str, list[str]]:
    """The bash script that runs the block, and the serve commands it stood for."""
    lines, serves = ["set -eo pipefail"], []
    for command in shell_commands(block):
        argv = serve_argv(command)
        if argv is not None:
            serves.append(command)
            continue
        expected = _EXIT_CODE.search(command)
        if expected:
            lines.append(f"if {command[:expected.start()]}\nthen rc=0; else rc=$?; fi\n"
                         f"[ $rc -eq {expected[1]} ] || {{ echo 'exit code '$rc', not {expected[1]}: '"
                         f"{shlex.quote(command)} >&2; exit 1; }}")
        else:
            lines.append(command)
    return "\n".join(lines) + "\n", serves


def pointed_at(code: str, base_url: str) -> str:
    address = base_url.removeprefix("http://")
    for written in SERVER_ADDRESSES:
        code = code.replace(written, address)
    return code


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A reader's checkout, as far as the snippets reach into it (scripts/), without letting
    them write into the real one (docs/img/ is theirs to overwrite)."""
    path = tmp_path_factory.mktemp("doc_snippets")
    (path / "scripts").symlink_to(ROOT / "scripts")
    return path


@pytest.fixture(scope="module")
def doc_server(workdir: Path):
    """`prefixserve serve random:qwen3-tiny --request-log requests.jsonl`, started from the
    working directory by the serve command's own functions, on a free port."""
    from prefixserve import LLMEngine
    from prefixserve.entrypoints.engine_args import engine_config_from_args
    from prefixserve.entrypoints.serve import server_config_from_args
    from prefixserve.entrypoints.server.app import build_app

    args = build_parser().parse_args([*SERVE_ARGV[:-1], str(workdir / SERVE_ARGV[-1])])
    app = build_app(LLMEngine(engine_config_from_args(args, max_waiting=None)), server_config_from_args(args))
    with LiveServer(app) as live:
        yield live


def run_shell(block: Block, workdir: Path, base_url: str) -> None:
    script, serves = shell_script(block)
    for command in serves:
        error = serve_options_error(serve_argv(command) or [])
        assert error is None, f"{block.where}: {command!r} does not parse:\n{error}"
    if block.not_run is not None:
        return
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(["bash", "-c", pointed_at(script, base_url)], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (f"{block.where} ({block.lang}) failed with exit code {proc.returncode}:\n"
                                  f"{script}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")


def run_python(block: Block, namespace: dict, base_url: str) -> None:
    if block.not_run is not None:
        compile(block.code, block.where, "exec")  # still valid Python
        return
    try:
        exec(compile(pointed_at(block.code, base_url), block.where, "exec"), namespace)
    except Exception as exc:
        raise AssertionError(f"{block.where} (python) raised {type(exc).__name__}: {exc}\n{block.code}") from exc


@pytest.mark.parametrize("document", list(documents()))
def test_every_snippet_of_the_document_runs(document, doc_server, workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    namespace: dict = {"__name__": "__snippet__"}
    for block in documents()[document]:
        if block.lang == "python":
            run_python(block, namespace, doc_server.base_url)
        elif block.lang in SHELLS:
            run_shell(block, workdir, doc_server.base_url)


def test_every_block_kept_from_running_says_why():
    kept = [(b.where, b.lang, b.not_run) for blocks in documents().values() for b in blocks
            if b.not_run is not None]
    print("\n".join(f"{where} ({lang}): {reason}" for where, lang, reason in kept))
    assert [where for where, _, reason in kept if not reason] == []


def test_a_not_run_mark_sits_right_before_a_fence():
    """A mark one line off would let its block run (and fail) or, worse, mark nothing: each mark
    in a document must be taken by the fence after it."""
    for path in DOCUMENTS:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if _NOT_RUN.fullmatch(line):
                assert i + 1 < len(lines) and _FENCE.match(lines[i + 1]), f"{path.name}:{i + 1}"


SAMPLE = """Intro.

```python
x = 1
```

<!-- not-run: needs a GPU -->
```bash
prefixserve generate hi --device cuda
```

- a list item:

  ```sh
  prefixserve lint requests.jsonl \\
      --format json   # exit code 0
  .venv/bin/prefixserve serve random:qwen3-tiny --port 8000 &
  cat > keys.json <<EOF
  {"sk-1": "acme"}
  EOF
  curl -s localhost:8000/v1/cached_contents -d '{
    "name": "handbook"}'
  ```

<!-- not-run:   -->
```console
$ prefixserve --version
prefixserve 0.1
```

```text
prefixserve serve --no-such-flag
```
"""


def test_the_reader_finds_each_block_its_language_and_its_mark():
    blocks = blocks_of(SAMPLE, "sample.md")
    assert [(b.line, b.lang, b.not_run) for b in blocks] == [
        (3, "python", None), (8, "bash", "needs a GPU"), (14, "sh", None), (26, "console", ""), (31, "text", None)]
    assert blocks[0].code == "x = 1\n"
    assert shell_commands(blocks[2]) == [
        "prefixserve lint requests.jsonl  --format json   # exit code 0",
        "prefixserve serve random:qwen3-tiny --port 8000 &",
        'cat > keys.json <<EOF\n{"sk-1": "acme"}\nEOF',
        'curl -s localhost:8000/v1/cached_contents -d \'{\n  "name": "handbook"}\'']
    assert shell_commands(blocks[3]) == ["prefixserve --version"]
    script, serves = shell_script(blocks[2])
    assert serves == ["prefixserve serve random:qwen3-tiny --port 8000 &"]
    assert "random:qwen3-tiny" not in script and "[ $rc -eq 0 ]" in script


def test_serve_options_are_checked_by_the_real_parser():
    assert serve_options_error(serve_argv("prefixserve serve random:qwen3-tiny --port 8000") or []) is None
    assert "--no-such-flag" in (serve_options_error(serve_argv("prefixserve serve --no-such-flag") or []) or "")
    assert "--port" in (serve_options_error(serve_argv("python -m prefixserve serve --port x") or []) or "")
    assert serve_argv("prefixserve lint requests.jsonl") is None


def test_a_failing_command_and_a_wrong_exit_code_fail_the_block(tmp_path):
    for code in ("false\necho never\n", "true   # exit code 1\n"):
        with pytest.raises(AssertionError, match="failed with exit code"):
            run_shell(Block("sample.md", 1, "bash", code, None), tmp_path, "http://127.0.0.1:1")
    run_shell(Block("sample.md", 1, "bash", "false   # exit code 1\n", None), tmp_path, "http://127.0.0.1:1")
