"""Plug-ins: a package installed with pip that declares a policy (``kvsim.policies``) and a command
(``kvsim.commands``) is seen by ``kvsim policies``, ``kvsim --help``, sweeps on worker processes and fuzz, with
no edit to kvsim. The package is built here as a wheel and installed by pip into its own target folder, which
the commands get on PYTHONPATH (the test venv itself is left as it was)."""
from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

POLICY = '''"""A plug-in scorer: keep the tokens with the largest value norm."""
from numba import njit

from policies import param_indices, register
from policies.core.shared_kernels import l2_norm
from policies.core.scorer import SCORE_PROMPT_SIG, SCORE_STEP_SIG, ScorerPolicy, protection

SCHEMA = protection(n_sink=1, n_recent=2)
P = param_indices(SCHEMA)


@njit(SCORE_PROMPT_SIG, cache=True)
def score_prompt(params, layer, q, k, v, scale, hi, scores, slot_state, head_state):
    for i in range(v.shape[0]):
        for h in range(v.shape[1]):
            scores[h, i] = l2_norm(v[i, h])


@njit(SCORE_STEP_SIG, cache=True)
def score_step(params, layer, t, lengths, probs, keys, values, positions, slot_state, head_state, hi, scores):
    for h in range(lengths.shape[0]):
        for i in range(lengths[h]):
            scores[h, i] = l2_norm(values[h, i])


@register
class PluginVNorm(ScorerPolicy):
    """Keep the tokens with the largest value norm (a plug-in's policy)."""
    name = "plugin_vnorm"
    summary = "plug-in: largest value norm kept"
    schema = SCHEMA
    P = P
    score_prompt = score_prompt
    score_step = score_step
'''

COMMAND = '''"""A plug-in command."""


def register(sub):
    p = sub.add_parser("hello-plugin", help="a command from an installed plug-in package")
    p.set_defaults(func=run)


def run(args):
    from policies import list_policies

    print("hello from the plug-in;", "plugin_vnorm" in list_policies(), "policy registered")
    return 0
'''

ENTRY_POINTS = '''[kvsim.commands]
hello-plugin = kvsim_demo_plugin.command:register

[kvsim.policies]
plugin_vnorm = kvsim_demo_plugin.policy
'''


def _wheel(path: Path) -> Path:
    """A pure-Python wheel of the plug-in package (what ``pip wheel`` would build from its pyproject)."""
    info = "kvsim_demo_plugin-0.1.dist-info"
    files = {"kvsim_demo_plugin/__init__.py": '"""A kvsim plug-in used by the tests."""\n',
             "kvsim_demo_plugin/policy.py": POLICY, "kvsim_demo_plugin/command.py": COMMAND,
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: kvsim-demo-plugin\nVersion: 0.1\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: kvsim-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
             f"{info}/entry_points.txt": ENTRY_POINTS}
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join(record + [f"{info}/RECORD,,"]) + "\n"
    whl = path / "kvsim_demo_plugin-0.1-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return whl


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plugin")
    site = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", "--target",
                    str(site), str(_wheel(tmp))], check=True, capture_output=True, text=True)
    assert (site / "kvsim_demo_plugin-0.1.dist-info" / "entry_points.txt").exists()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), KVSIM_THREADS="1", COLUMNS="300")
    return env, tmp


def kvsim(env, *argv, cwd=None):
    proc = subprocess.run([sys.executable, "-m", "sim.cli", *argv], env=env, capture_output=True, text=True,
                          cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_installed_plugin_policy_and_command_reach_every_command(plugin_env):
    env, tmp = plugin_env
    listing = kvsim(env, "policies")
    assert "plugin_vnorm" in listing and "ada(plugin_vnorm)" in listing and "plug-in: largest value norm" in listing
    helptext = kvsim(env, "--help")
    assert "hello-plugin" in helptext and "a command from an installed plug-in package" in helptext
    assert "True policy registered" in kvsim(env, "hello-plugin")
    out = kvsim(env, "sweep", "synthetic:mixed", "--tokens", "96", "--prompt", "32", "--layers", "1",
                "--policies", "plugin_vnorm;ada(plugin_vnorm)", "--budgets", "16,24", "--workers", "2",
                "--quiet", "--out", str(tmp / "store"))
    assert "plugin_vnorm" in out and "ada(plugin_vnorm)" in out
    fuzz = kvsim(env, "fuzz", "--policies", "plugin_vnorm", "--examples", "20", "--save-failures", str(tmp / "fz"))
    assert "plugin_vnorm" in fuzz


def test_a_broken_plugin_is_named_and_the_rest_still_works(tmp_path):
    site = tmp_path / "site"
    info = site / "broken_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[kvsim.commands]\nbroken = no_such_module_here\n\n"
                                           "[kvsim.policies]\nbroken = no_such_module_either\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-m", "sim.cli", "policies"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0 and "h2o" in proc.stdout
    assert "command plug-in 'broken'" in proc.stderr and "no_such_module_here" in proc.stderr
    assert "policy plug-in 'broken'" in proc.stderr and "no_such_module_either" in proc.stderr
