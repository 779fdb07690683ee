"""README command 1 installs kvsim without the test extra: no CLI path may import a test-only package."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_BLOCKED_RUN = r'''
import importlib, importlib.abc, pkgutil, sys

BLOCKED = {"hypothesis", "pytest", "_pytest", "ray", "lm_eval", "wonderwords"}


class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: not installed without the test extra)",
                                      name=name)
        return None


for mod in [m for m in sys.modules if m.split(".")[0] in BLOCKED]:
    del sys.modules[mod]
sys.meta_path.insert(0, Block())

import sim.cli
import sim.commands

names = [m.name for m in pkgutil.iter_modules(sim.commands.__path__)]
for name in names:
    importlib.import_module(f"sim.commands.{name}")
parser = sim.cli.build_parser()
for action in parser._subparsers._group_actions:
    for sub in action.choices.values():
        sub.format_help()
assert sim.cli.main(["fuzz", "h2o"]) == 2          # a clear error instead of a crash at import
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
assert not leaked, leaked
print("ok", len(names))
'''


def test_every_cli_module_imports_without_test_only_packages():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", _BLOCKED_RUN], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("ok ") and int(res.stdout.split()[1]) >= 10
    assert "kvsim fuzz needs hypothesis" in res.stderr
