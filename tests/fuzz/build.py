"""Builds every C extension of tokentrace with AddressSanitizer, UndefinedBehaviorSanitizer (in trap
mode: no runtime of its own) and libFuzzer's coverage instrumentation, for tests/fuzz/fuzz.py.

The sources and flags are pyproject.toml's ext-modules (read from it, so a new source file is
fuzzed without touching this), compiled by clang (Debian's clang-14) with
``-fsanitize=address,undefined -fsanitize-trap=undefined -fsanitize=fuzzer-no-link``; the modules are
written to ``OUT/<module name><EXT_SUFFIX>`` and loaded by fuzz.py in place of the installed ones.
The ASan and libFuzzer runtimes are atheris's (``asan_with_fuzzer.so``, preloaded by fuzz.py's
caller). A build is skipped when its output is newer than its sources.

    python tests/fuzz/build.py [OUT]        (default build/fuzz)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "build" / "fuzz"
SANITIZE = ["-fsanitize=address,undefined", "-fsanitize-trap=undefined", "-fno-sanitize-recover=all",
            "-fsanitize=fuzzer-no-link", "-fno-omit-frame-pointer", "-g", "-O1"]


def compiler(name: str) -> str:
    """clang or clang++ (Debian's versioned names too)."""
    for candidate in (name, f"{name}-14", f"{name}-15", f"{name}-16", f"{name}-19"):
        if shutil.which(candidate):
            return candidate
    raise SystemExit(f"tests/fuzz/build.py: no {name} (apt-get install clang-14)")


#: The harness's self-test: a module with a deliberate overflow (canary.c), built the same way.
CANARY = {"name": "tokentrace_fuzz_canary", "sources": ["tests/fuzz/canary.c"],
          "extra-compile-args": ["-std=c11", "-Wall"]}


def modules() -> list[dict]:
    """pyproject.toml's ext-modules (name, sources, depends, extra-compile-args), and the canary."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return [*project["tool"]["setuptools"]["ext-modules"], CANARY]


def build(out: Path = DEFAULT_OUT) -> list[Path]:
    """Build every module into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    include = sysconfig.get_paths()["include"]
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    built = []
    for module in modules():
        target = out / (module["name"] + suffix)
        sources = [ROOT / s for s in module["sources"]] + [ROOT / d for d in module.get("depends", [])]
        built.append(target)
        if target.exists() and target.stat().st_mtime > max(s.stat().st_mtime for s in sources):
            continue
        objects = []
        for source in module["sources"]:
            cpp = source.endswith(".cpp")
            obj = out / (module["name"] + "." + Path(source).name + ".o")
            flags = [f for f in module.get("extra-compile-args", []) if not f.startswith("-O")]
            if cpp:
                flags = [f for f in flags if f != "-std=c11"] + ["-std=c++17"]
            cmd = [compiler("clang++" if cpp else "clang"), "-c", "-fPIC", *SANITIZE, *flags, f"-I{include}",
                   f"-I{ROOT / Path(source).parent}", str(ROOT / source), "-o", str(obj)]
            subprocess.run(cmd, check=True)
            objects.append(str(obj))
        link = [compiler("clang++"), "-shared", "-fsanitize=address,undefined", "-fsanitize-trap=undefined",
                "-fsanitize=fuzzer-no-link", *objects, "-o", str(target)]
        subprocess.run(link, check=True)
    return built


if __name__ == "__main__":
    for path in build(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT):
        print(path)
    sys.exit(0)
