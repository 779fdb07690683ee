"""The ``kvsim`` model type of lm-evaluation-harness (gpu_validate/lm_eval_model.py), run through lm-eval itself on
tasks written here (a local JSON data set: multiple choice, generation, rolling log-likelihood), against lm-eval's
own ``hf`` model: ``policy=full`` gives hf's numbers, a compressing policy changes them. The tiny model always, the
real SmolLM2 when it is in the model cache. lm-eval is the ``eval`` extra (and in the ``test`` extra)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'kvsim[eval]')")

from traces.model import read_text  # noqa: E402

TASKS = ("kvsim_t_mc", "kvsim_t_gen", "kvsim_t_ppl")


def write_tasks(folder: Path, n_docs: int, n_words: int) -> Path:
    """Three lm-eval tasks over ``n_docs`` passages of the shipped held-out text: pick the true next 4 words among
    4 (loglikelihood), generate up to 6 tokens (generate_until, exact match of the next word), and the rolling
    log-likelihood of a passage (word perplexity)."""
    words = read_text("default")[0].split()
    rows = []
    for i in range(n_docs):
        s = 300 + 97 * i
        rows.append({"context": " ".join(words[s:s + n_words]), "label": 0, "target": words[s + n_words],
                     "choices": [" ".join(words[s + n_words:s + n_words + 4])]
                     + [" ".join(words[s + 500 + 31 * j:s + 504 + 31 * j]) for j in range(3)],
                     "text": " ".join(words[s:s + 2 * n_words])})
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
              "doc_to_text: '{{context}}'\n")
    (folder / "mc.yaml").write_text(f"task: {TASKS[0]}\n{common}output_type: multiple_choice\n"
                                    "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\n"
                                    "metric_list:\n  - metric: acc\n")
    (folder / "gen.yaml").write_text(f"task: {TASKS[1]}\n{common}output_type: generate_until\n"
                                     "doc_to_target: '{{target}}'\ngeneration_kwargs:\n  until: ['\\n']\n"
                                     "  max_gen_toks: 6\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n")
    (folder / "ppl.yaml").write_text(f"task: {TASKS[2]}\n{common.replace('{{context}}', '')}"
                                     "output_type: loglikelihood_rolling\ndoc_to_target: '{{text}}'\n"
                                     "metric_list:\n  - metric: word_perplexity\n")
    return folder


def evaluate(model: str, model_args: str, folder: Path, tasks: tuple[str, ...] = TASKS) -> dict:
    from lm_eval.tasks import TaskManager

    import gpu_validate.lm_eval_model  # noqa: F401  (registers "kvsim")

    # the tasks written here only: indexing lm-eval's own ~14 000 task YAML files took 6-7 s per call
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(tasks),
                                   task_manager=TaskManager(include_path=str(folder), include_defaults=False),
                                   batch_size=1, log_samples=True, device="cpu")


def responses(out: dict) -> dict[str, list]:
    return {t: [s["filtered_resps"] for s in samples] for t, samples in out["samples"].items()}


def assert_same_numbers(a: dict, b: dict) -> None:
    """Per request: log-likelihoods within 1e-3 nats, the same greedy flags and generated text; the same metrics."""
    ra, rb = responses(a), responses(b)
    assert set(ra) == set(rb)
    for task in (t for t in (TASKS[0], TASKS[2]) if t in ra):
        for xa, xb in zip(ra[task], rb[task], strict=True):
            flat_a = [v for r in xa for v in (r if isinstance(r, (list, tuple)) else [r])]
            flat_b = [v for r in xb for v in (r if isinstance(r, (list, tuple)) else [r])]
            assert flat_a == pytest.approx(flat_b, abs=1e-3)
    assert ra[TASKS[1]] == rb[TASKS[1]]
    for task in ra:
        ma = {k: v for k, v in a["results"][task].items() if "," in k and "stderr" not in k}
        mb = {k: v for k, v in b["results"][task].items() if "," in k and "stderr" not in k}
        assert ma == pytest.approx(mb, rel=1e-4), task


@pytest.fixture(scope="module")
def tiny_tasks(tmp_path_factory):
    return write_tasks(tmp_path_factory.mktemp("lm_eval_tasks"), n_docs=2, n_words=32)


@pytest.fixture(scope="module")
def tiny_hf(tiny_tasks):
    from traces.models import resolve_model

    return evaluate("hf", f"pretrained={resolve_model('tiny', progress=False)},dtype=float32", tiny_tasks)


def test_full_policy_reproduces_hf_on_the_tiny_model(tiny_tasks, tiny_hf):
    ours = evaluate("kvsim", "model=tiny,policy=full", tiny_tasks)
    assert_same_numbers(tiny_hf, ours)
    assert ours["config"]["model"] == "kvsim"


def test_a_compressing_policy_changes_the_scores(tiny_tasks, tiny_hf):
    """knorm at 12 slots per head: the contexts (about 50 tokens) are compressed, and the log-likelihoods move."""
    ours = evaluate("kvsim", "model=tiny,policy=knorm:n_sink=4;n_recent=1,budget=12", tiny_tasks, TASKS[:1])
    a = [v for r in responses(tiny_hf)[TASKS[0]] for x in r for v in x]
    b = [v for r in responses(ours)[TASKS[0]] for x in r for v in x]
    assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) > 0.05
    info = ours["config"]["model_args"]
    assert "knorm" in str(info)


def test_a_policy_without_budget_is_refused():
    import gpu_validate.lm_eval_model as m

    with pytest.raises(m.ValidateError, match="needs budget"):
        m.KVSimLM(model="tiny", policy="knorm")


def test_the_command_line_names_the_tokenizer(monkeypatch):
    """lm-eval's RULER tasks load the tokenizer named in --model_args: the wrapper adds the resolved folder."""
    from gpu_validate.lm_eval_model import _with_tokenizer
    from traces.models import resolve_model

    got = _with_tokenizer(["--model", "kvsim", "--model_args", "model=tiny,policy=full", "--tasks", "x"])
    assert got[3] == f"model=tiny,policy=full,tokenizer={resolve_model('tiny', progress=False)}"
    assert _with_tokenizer(["--model", "hf", "--model_args", "pretrained=x"])[3] == "pretrained=x"


def test_smollm2_full_policy_reproduces_hf(tmp_path):
    from traces.models import entry, is_cached, resolve_model

    if not is_cached(entry("smollm2-135m")):
        pytest.skip("smollm2-135m is not in the model cache (kvsim models --fetch smollm2-135m)")
    folder = write_tasks(tmp_path, n_docs=1, n_words=40)
    # multiple choice and generation: a rolling log-likelihood teacher-forces its whole text token by token through
    # the closed loop (minutes on this CPU for SmolLM2), so it is checked on the tiny model only
    tasks = TASKS[:2]
    hf = evaluate("hf", f"pretrained={resolve_model('smollm2-135m', progress=False)},dtype=float32", folder, tasks)
    assert_same_numbers(hf, evaluate("kvsim", "model=smollm2-135m,policy=full", folder, tasks))


def test_module_runs_lm_evals_own_command_line(tiny_tasks, tmp_path):
    """``python -m gpu_validate.lm_eval_model`` is lm-eval's command line with the kvsim model type registered."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-m", "gpu_validate.lm_eval_model", "--model", "kvsim", "--model_args",
                          "model=tiny,policy=streaming_llm,budget=16", "--tasks", TASKS[0], "--include_path",
                          str(tiny_tasks), "--device", "cpu", "--limit", "1", "--output_path", str(tmp_path / "out")],
                         capture_output=True, text=True, cwd=root, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(root), "HF_DATASETS_OFFLINE": "1",
                              "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "kvsim_t_mc" in res.stdout and "acc" in res.stdout
