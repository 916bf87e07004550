"""Issue 15, "a first hour that just works": what a new user trips over in --help, --url and the
install (README's command itself: tests/test_readme_first_command.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _help(*command: str) -> str:
    out = subprocess.run([sys.executable, "-m", "tokentrace", *command, "--help"], capture_output=True, text=True,
                         timeout=60, env={"COLUMNS": "100", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_help_texts_have_no_rst_marks_and_keep_examples_on_their_lines():
    analyze = _help("analyze")
    assert "``" not in analyze and "from the command line: tokentrace analyze slow|cache|" in analyze
    export = _help("export")
    assert "``" not in export
    lines = export.splitlines()
    assert "    tokentrace export perfetto --since 10m -o trace.json" in lines
    assert "    tokentrace export perfetto --request-id REQ -o request.json --db tokentrace.duckdb" in lines


def test_parse_workers_shows_one_default():
    text = " ".join(_help("collector").split())
    at = text.index("--parse-workers PARSE_WORKERS processes")  # the option's help, not the usage line
    option = text[at:text.index(" --", at + 10)]
    assert option.count("default") == 1, option
    assert "default: cores - 1, at most 4" in option


def test_url_without_a_scheme_reaches_the_collector(collector_factory):
    collector = collector_factory().start()
    out = subprocess.run([sys.executable, "-m", "tokentrace", "analyze", "report", "--since", "all",
                          "--url", f"127.0.0.1:{collector.port}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "no requests in the window" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "tokentrace", "analyze", "report", "--url", "ftp://127.0.0.1:1"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--url must be an http:// or https:// address" in bad.stderr


@pytest.mark.slow
def test_building_the_package_warns_of_no_unlisted_package(tmp_path):
    """setuptools warned on every install that the SQL, template and static folders look like
    packages but are not configured; they are listed now, and shipped."""
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-v",
                          "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "is absent from the `packages` configuration" not in out.stdout + out.stderr
    wheel = next(tmp_path.glob("tokentrace-*.whl"))
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    for shipped in ("tokentrace/collector/stores/sql/duckdb/001_init.sql", "tokentrace/dashboards/templates/base.html",
                    "tokentrace/dashboards/grafana/tokentrace.json"):
        assert shipped in names, shipped


# --- issue 47, "the first hour, polished" -------------------------------------------------------------

@pytest.mark.parametrize("extra", [(), ("--json",)], ids=["text", "json"])
def test_a_reader_that_stops_early_gets_no_traceback(collector_factory, extra):
    """``tokentrace analyze ... | head -1``: the reader is gone before the answer is written."""
    collector = collector_factory().start()
    read, write = os.pipe()
    os.close(read)  # the reader left: every write to the pipe fails (EPIPE)
    try:
        out = subprocess.run([sys.executable, "-m", "tokentrace", "analyze", "report", "--since", "all",
                              "--url", collector.url, *extra], stdout=write, stderr=subprocess.PIPE, text=True,
                             timeout=120)
    finally:
        os.close(write)
    assert "Traceback" not in out.stderr and "BrokenPipeError" not in out.stderr, out.stderr
    assert out.returncode == 120, (out.returncode, out.stderr)


def test_a_busy_port_is_one_line_for_the_gateway():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "tokentrace", "gateway", "--port", str(port), "--upstream",
                              "a=http://127.0.0.1:9"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr == (f"tokentrace gateway: error: --port {port}: cannot listen on 127.0.0.1:{port}: "
                          "Address already in use\n"), out.stderr


def test_help_lists_the_choices_of_closed_options():
    text = " ".join(_help("gateway").split())
    assert "--route {round_robin,least_loaded,session,prefix}" in text
    assert "one of round_robin, least_loaded, session, prefix (default: round_robin)" in text
