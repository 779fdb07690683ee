"""RULER-style retrieval tasks: prompt construction (exact length, evidence positions, depth, wrap-around filler),
the success check, the closed loop over several tasks, and the runner's shared prompt forward."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_validate.closedloop.jobs import BatchJob
from gpu_validate.validate_error import ValidateError
from gpu_validate.studies.needle.runs import run_needle
from gpu_validate.studies.needle.prompts import make_grid, make_prompt
from gpu_validate.closedloop.runner import run_batch
from gpu_validate.studies.needle.tasks import TASKS, build_task, retrieved
from policies.core.registry import get_policy
from sim.experiments.store import ResultStore
from tests.test_needle import TEXT, CharTok


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()


@settings(max_examples=30, deadline=None)
@given(task=st.sampled_from(sorted(TASKS)), depth=st.floats(0.0, 1.0), seed=st.integers(0, 50),
       repeats=st.integers(1, 2), length=st.integers(700, 1500))
def test_every_task_prompt_has_exact_length_and_evidence(task, depth, seed, repeats, length):
    tok = CharTok()
    p = make_prompt(tok, tok.encode(TEXT[:500]), length, depth, seed, task=task, repeats=repeats)   # filler wraps
    assert len(p.ids) == length and p.task == task and p.values
    text = tok.decode(list(p.ids))
    evidence = tok.decode([p.ids[i] for i in p.key_positions])
    spec = build_task(task, np.random.default_rng(0), depth, repeats)
    for v in p.values:
        assert text.count(v) >= repeats and v in evidence           # every value sits in the prompt, as evidence
    assert retrieved(tok.decode(list(p.answer)), p.values)          # the canonical answer passes the check
    assert p.n_generate >= len(p.answer)
    assert len(spec.needles) >= 1
    assert p == make_prompt(tok, tok.encode(TEXT[:500]), length, depth, seed, task=task, repeats=repeats)


def test_depth_places_the_queried_needle_and_prompt_ids_keep_the_old_grid():
    tok = CharTok()
    filler = tok.encode(TEXT)
    for task in TASKS:
        near = make_prompt(tok, filler, 900, 0.0, 1, task=task)
        far = make_prompt(tok, filler, 900, 1.0, 1, task=task)
        first = {p: tok.decode(list(p.ids)).find(p.key) for p in (near, far)}
        assert first[near] < first[far]
    assert make_prompt(tok, filler, 900, 0.5, 2).prompt_id == "L900-d0.5-s2"
    assert make_prompt(tok, filler, 900, 0.5, 2, repeats=2).prompt_id == "passkeyx2-L900-d0.5-s2"
    assert make_prompt(tok, filler, 900, 0.5, 2, task="vartrack").prompt_id == "vartrack-L900-d0.5-s2"
    with pytest.raises(ValidateError, match="unknown task"):
        make_prompt(tok, filler, 900, 0.5, 2, task="summarise")
    with pytest.raises(ValidateError, match="repeats"):
        make_prompt(tok, filler, 900, 0.5, 2, repeats=0)


def test_retrieved_needs_every_value_as_a_whole_token_run():
    assert retrieved(" 12345, 67890 and more", ("12345", "67890"))
    assert not retrieved(" 12345", ("12345", "67890"))
    assert not retrieved(" 123456", ("12345",)) and not retrieved("VAR ABCDEF", ("ABCDE",))
    assert retrieved("VAR ABCDE, VAR QWERT.", ("ABCDE", "QWERT"))


def test_multivalue_success_reads_the_decoded_generation(llama, tmp_path):
    tok = CharTok()
    prompts = make_grid(tok, TEXT, [700], [0.5], [0], tasks=["multivalue", "multikey"])
    configs = [(get_policy("full"), 1), (get_policy("h2o"), 64), (get_policy("snapkv"), 64),
               (get_policy("snapkv"), 700)]                   # a budget >= the context is the full cache: not run
    store = ResultStore(tmp_path / "s")
    df = run_needle(llama, prompts, configs, store, model_id="tiny", progress=False, decode=tok.decode, chunk=0,
                    log=lambda s: None)
    assert len(df) == 6 and set(df.task) == {"multivalue", "multikey"} and set(df.chunk) == {0}
    for _, row in df.iterrows():
        p = next(q for q in prompts if q.prompt_id == row.prompt_id)
        import json
        assert bool(row.success) == retrieved(tok.decode(json.loads(row.generated)[:p.n_generate]), p.values)


def test_a_prompt_goes_through_the_model_once_for_streamed_and_prefilled_rows(llama, monkeypatch):
    import gpu_validate.closedloop.prompt_store as prompt_store

    tok = CharTok()
    p = make_prompt(tok, tok.encode(TEXT), 400, 0.5, 0)
    jobs = [BatchJob(get_policy("h2o"), 64, p.ids, n_generate=6, chunk=400),
            BatchJob(get_policy("snapkv"), 64, p.ids, n_generate=6),
            BatchJob(get_policy("tova"), 32, p.ids, n_generate=6, chunk=400)]
    alone = [run_batch(llama, [j])[0] for j in jobs]
    calls = []
    real = prompt_store.forward_in_chunks

    def counted(*a, **k):
        calls.append(1)
        yield from real(*a, **k)

    monkeypatch.setattr(prompt_store, "forward_in_chunks", counted)
    together = run_batch(llama, jobs)
    assert len(calls) == 1                       # two batches (streamed, prefilled), one prompt forward
    for a, b in zip(alone, together):
        assert a.generated == b.generated and np.array_equal(a.top1, b.top1)


def test_solved_only_runs_a_prompts_policies_only_where_the_full_cache_retrieves(llama, monkeypatch, tmp_path):
    import gpu_validate.closedloop.prompt_store as prompt_store
    from gpu_validate.studies.needle.prompts import NeedlePrompt

    tok = CharTok()
    prompts = make_grid(tok, TEXT, [400], [0.5], [1, 2], tasks=["single"])
    monkeypatch.setattr(NeedlePrompt, "success", lambda self, generated, decode=None: self.seed == 1)
    calls = []
    real = prompt_store.forward_in_chunks

    def counted(*a, **k):
        calls.append(1)
        yield from real(*a, **k)

    monkeypatch.setattr(prompt_store, "forward_in_chunks", counted)
    configs = [(get_policy("full"), 1), (get_policy("h2o"), 64), (get_policy("snapkv"), 64)]
    store = ResultStore(tmp_path / "s")
    logs = []
    df = run_needle(llama, prompts, configs, store, model_id="tiny", progress=False, chunk=0, solved_only=True,
                    log=logs.append)
    assert len(calls) == 2                                # one prompt forward per prompt, full cache included
    assert sorted(df[df.seed == 1].policy) == ["full", "h2o", "snapkv"]
    assert list(df[df.seed == 2].policy) == ["full"]     # the full cache fails it: its policies are not run
    assert any("2 cells not run" in m for m in logs)
    calls.clear()
    again = run_needle(llama, prompts, configs, store, model_id="tiny", progress=False, chunk=0, solved_only=True,
                       log=logs.append)                   # resumed: the stored full-cache outcome gates
    assert calls == [] and len(again) == len(df)
    with pytest.raises(ValidateError, match="full cache"):
        run_needle(llama, prompts, configs[1:], store, model_id="tiny", progress=False, solved_only=True)
    # a cell that cannot reach the bar stops running policies: 3 prompts, 0.9 allows no failure
    grid = make_grid(tok, TEXT, [420], [0.0, 0.5, 1.0], [1, 2], tasks=["single"])  # run by id: d0-s1, d0-s2, ...
    df = run_needle(llama, grid, configs, ResultStore(tmp_path / "t"), model_id="tiny", progress=False, chunk=0,
                    solved_only=True, min_full_accuracy=0.9, log=lambda s: None)
    assert len(df[df.policy == "full"]) == 6                     # the full cache on every prompt, for the report
    assert set(df[df.policy != "full"].prompt_id) == {"single-L420-d0-s1"}   # none after d0-s2's failure


def test_needle_cli_runs_several_tasks_and_drops_cells_the_full_cache_fails(llama, tmp_path, capsys):
    import json
    import string

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from sim.cli import main

    vocab = {c: i for i, c in enumerate(string.printable[:100])} | {"[UNK]": 100}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]").save_pretrained(tmp_path / "m")
    llama.save_pretrained(tmp_path / "m")
    (tmp_path / "text.txt").write_text(TEXT)
    out = tmp_path / "r.json"
    args = ["needle", "--model", str(tmp_path / "m"), "--text", str(tmp_path / "text.txt"), "--lengths", "700",
            "--depths", "0,1", "--seeds", "1,2", "--tasks", "passkey,vartrack", "--repeats", "2",
            "--policies", "h2o;snapkv", "--budgets", "64", "--prompt-chunk", "0", "--store", str(tmp_path / "s"),
            "--out", str(out), "--quiet"]
    assert main(args) == 0
    rep = json.loads(out.read_text())
    assert rep["tasks"] == ["passkey", "vartrack"] and set(rep["by_task"]) <= {"passkey", "vartrack"}
    assert set(rep["full_accuracy_by_cell"]) == {"passkey@700", "vartrack@700"} and rep["prompt_chunk"] == 0
    assert len(rep["prompt_ids"]) == 8 and set(rep["task_plots"]) == set(rep["by_task"])
    assert "<h2" in (tmp_path / "r.html").read_text() and "Tasks" in (tmp_path / "r.html").read_text()
    # judged on the prompts the full cache retrieves only: there the full cache scores 1 in every cell
    rc = main(args + ["--solved-only"])
    if rep["full_accuracy"] == 0:                     # nothing solved: nothing to judge, said so
        assert rc == 1
    else:
        rep = json.loads(out.read_text())
        assert rc == 0 and rep["solved_only"] and rep["full_accuracy"] == 1.0
        assert len(rep["prompt_ids"]) == rep["n_solved_prompts"] < rep["n_prompts"] + 1
    # a random-weight model fails every cell: with a 0.9 floor nothing is left to report, and it says so
    assert main(args + ["--min-full-accuracy", "0.9"]) == 1
    assert "the full cache fails every (task, length) cell" in capsys.readouterr().out
    # NAME:MAXLEN keeps a task to the lengths up to MAXLEN
    capped = [x if x != "passkey,vartrack" else "passkey,vartrack:600" for x in args]
    capped[capped.index("700")] = "600,700"
    assert main(capped) == 0
    rep = json.loads(out.read_text())
    assert set(rep["full_accuracy_by_cell"]) == {"passkey@600", "passkey@700", "vartrack@600"}
    assert rep["task_max_length"] == {"vartrack": 600}
    with pytest.raises(SystemExit):
        main([*args[:args.index("--tasks") + 1], "vartrack:many", *args[args.index("--tasks") + 2:]])


def test_held_reads_replayed_layers_kept_windows_and_the_prompt_forward():
    from types import SimpleNamespace

    from gpu_validate.studies.needle.prediction import _held

    P, A, key = 20, 3, np.array([5, 17])
    kept = np.full((1, A, 1, 4), -1, np.int32)          # the one replayed layer (stored layer 1), one KV head
    kept[0, :, 0, :2] = [5, 19]                           # holds key token 5, not 17
    res = SimpleNamespace(kept=kept, layer_index=np.array([1]))
    held = _held(res, key, (2, A, 2, 2), windows=[4, None], P=P, first_full=True)
    assert held[:, 0].all()                               # first answer step: the prompt's own forward
    assert (held[1, 1:, :, 0]).all() and not held[1, 1:, :, 1].any()      # replayed: its kept set
    assert not held[0, 1:, :, 0].any() and held[0, 1, :, 1].all()         # sliding layer kept: its window of 4
    assert not held[0, 2, :, 1].any()                     # (query 21 sees 18..21: token 17 has left the window)
    streamed = _held(res, key, (2, A, 2, 2), windows=[4, None], P=P, first_full=False)
    assert not streamed[1, 0, :, 1].any()                 # token by token: the cache the prompt left
