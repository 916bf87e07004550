"""Issue 15: README's first command, exactly as written, in a fresh copy of the repository (so a fresh
``.venv``): it installs, runs the demo, prints the verdicts, keeps the dashboard up until Ctrl-C,
and leaves no temporary directory behind."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
from pathlib import Path

import pytest
from test_demo import check_table

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    """The lines of README's first code block: the two commands at the top."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```\n(.*?)```", text, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_readme_starts_with_exactly_two_commands():
    commands = readme_commands()
    assert len(commands) == 2, commands
    assert commands[1] == "bash tests/run"
    first = commands[0]
    # Debian's own Python refuses a bare pip install (externally-managed-environment).
    assert first.startswith("python3 -m venv ") and "tokentrace demo" in first, first


def _copy_repository(to: Path) -> Path:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.splitlines()
    for name in listed:
        source = ROOT / name
        if source.is_file():
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, to / name)
    return to


def test_readme_first_command_runs_the_demo(tmp_path):
    command = readme_commands()[0]
    checkout = _copy_repository(tmp_path / "tokentrace")
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p)
    env["TMPDIR"] = str(temp)  # where the demo makes (and must remove) its temporary directory
    proc = subprocess.Popen(["bash", "-c", command], cwd=checkout, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    serving = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "until Ctrl-C" in line:
                serving.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # Creating the venv and installing from pip's cache take minutes on a small shared machine.
        assert serving.wait(1500), "".join(lines[-80:])
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    reader.join(30)
    proc.stdout.close()
    out = "".join(lines)
    assert re.search(r"(\d+) of \1 verdicts as expected", out), out[-4000:]
    check_table(out)
    assert "dashboard: http://127.0.0.1:" in out
    assert not list(temp.glob("tokentrace-demo-*")), "the demo left its temporary directory behind"
    assert (checkout / ".venv" / "bin" / "tokentrace").exists()


def test_chinese_quick_start_is_linked_and_has_the_same_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "(docs/zh/README.md)" in readme.split("```")[0], "linked from the top of the README"
    zh = (ROOT / "docs" / "zh" / "README.md").read_text(encoding="utf-8")
    for command in readme_commands():
        assert command in zh, command
    for word in ("首 Token", "预填充", "KV Cache", "冷启动", "X-Request-Id", "tokentrace collector",
                 "tokentrace engine", "analyze slow", "analyze cache"):
        assert word in zh, word
