"""kvsim's cache inside transformers' generate(): the full cache is the model's own generate token for token, a
policy is the evaluation runner's closed loop token for token (open loop: the simulator's kept sets), a batch of
prompts of different lengths is its rows run alone, the bytes held stay within the budget, and what cannot run
is refused by name. Random-weight Llama / Gemma-3 configs (a sliding window of 8, generated past), the shipped
tiny model through `kvsim generate`, and SmolLM2 / Gemma-3-270M when they are in the model cache."""
import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported (as tests/test_validate.py)

import pytest
import torch

from gpu_validate.closedloop.model_metrics import compare_kept
from gpu_validate.generation import KVSimCache, generate, kvsim_cache
from gpu_validate.validate_error import ValidateError
from gpu_validate.closedloop.runner import CompressedRunner
from sim.cli import main
from sim.replay.policy_replay import replay
from sim.experiments.specs import parse_policy
from traces.format import load_trace
from traces.hf.forward import cache_keyword
from traces.recorder import record_trace
from tests.random_models import random_gemma3, random_llama

torch.set_num_threads(1)
WINDOW = 8


@pytest.fixture(scope="module")
def llama():
    return random_llama()


@pytest.fixture(scope="module")
def gemma():
    return random_gemma3(window=WINDOW)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 101, (48,), generator=torch.Generator().manual_seed(1)).tolist()


def _hf_generate(model, prompts, n, **kw) -> list[list[int]]:
    """transformers' own generate (its DynamicCache, SDPA) of left-padded prompts: the new tokens per row."""
    T = max(map(len, prompts))
    pad = model.generation_config.pad_token_id or 0
    x = torch.tensor([[pad] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(x, attention_mask=mask, max_new_tokens=n, pad_token_id=pad, **kw)
    return [_until_eos(model, row) for row in out[:, T:].tolist()]


def _until_eos(model, tokens: list[int]) -> list[int]:
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    return next((tokens[:i + 1] for i, t in enumerate(tokens) if t in eos), tokens)


def _tokens(res) -> list[list[int]]:
    return [row.new_tokens for row in res.rows]


# ----- the full cache is transformers' own generate -----

def test_full_cache_is_transformers_generate_greedy_and_batched(llama, ids):
    """Greedy, one prompt and a left-padded batch of three lengths: the tokens of model.generate."""
    assert _tokens(generate(llama, [ids[:20]], "full", max_new_tokens=12)) == _hf_generate(llama, [ids[:20]], 12,
                                                                                           do_sample=False)
    prompts = [ids[:20], ids[5:14], ids[2:30]]
    assert _tokens(generate(llama, prompts, "full", max_new_tokens=10)) == _hf_generate(llama, prompts, 10,
                                                                                        do_sample=False)


def test_full_cache_sampling_is_transformers_sampling(llama, ids):
    """Sampling at a temperature from the same seed draws the same tokens (the same probabilities)."""
    ours = _tokens(generate(llama, [ids[:16]], "full", max_new_tokens=10, temperature=0.8, seed=3))
    torch.manual_seed(3)
    assert ours == _hf_generate(llama, [ids[:16]], 10, do_sample=True, temperature=0.8)


@pytest.mark.parametrize("sliding", ["keep", "compress"])
def test_gemma3_full_cache_past_its_window_is_transformers_generate(gemma, ids, sliding):
    """Sliding-window layers (window 8) generated far past their window: model.generate's tokens."""
    ours = generate(gemma, [ids[:12]], "full", max_new_tokens=20, sliding=sliding)
    assert _tokens(ours) == _hf_generate(gemma, [ids[:12]], 20, do_sample=False)


def test_shipped_tiny_model_full_cache_through_the_cli(ids, capsys):
    """`kvsim generate --policy full --json` on the shipped model: transformers' greedy tokens, text streamed
    first, one JSON object last."""
    from traces.models import load_model

    model, tok = load_model("tiny", progress=False)
    prompt = "Return the list of"
    assert main(["generate", "--model", "tiny", "--policy", "full", "--prompt", prompt, "--max-new-tokens", "12",
                 "--json"]) == 0
    lines = capsys.readouterr().out.rstrip("\n").split("\n")
    res = json.loads(lines[-1])
    assert res["new_tokens"] == _hf_generate(model, [tok(prompt)["input_ids"]], 12, do_sample=False)[0]
    assert "\n".join(lines[:-1]) == res["text"] and res["text"]
    assert res["kv_bytes_held"] == res["kv_bytes_full_cache"] > 0 and res["tokens_per_s"] > 0
    assert (res["policy"], res["budget"]) == ("full", None)


def test_cli_with_a_policy_and_its_errors(tmp_path, capsys):
    """A combinator policy from a prompt file holds less than the full cache; a missing budget and an unknown
    policy are one-line errors (status 2)."""
    f = tmp_path / "p.txt"
    f.write_text("import os\nimport sys\n\ndef main(argv):\n    " * 4, encoding="utf-8")
    assert main(["generate", "--model", "tiny", "--policy", "decoding(snapkv, every=4)", "--budget", "8",
                 "--prompt-file", str(f), "--max-new-tokens", "6", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.rstrip("\n").split("\n")[-1])
    assert 0 < res["kv_bytes_held"] < res["kv_bytes_full_cache"] and len(res["new_tokens"]) <= 6
    assert main(["generate", "--model", "tiny", "--policy", "h2o", "--prompt", "x"]) == 2
    assert "--budget is required" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny", "--policy", "nope", "--budget", "8", "--prompt", "x"]) == 2


# ----- a policy is the evaluation runner's closed loop -----

@pytest.mark.parametrize("spec,budget,chunk", [
    ("h2o", 8, 1), ("tova", 6, 1), ("snapkv", 8, 1), ("streaming_llm", 8, 1), ("buzz", 12, 1), ("d2o", 8, 1),
    ("decoding(snapkv, every=4)", 10, 1), ("critical(ada(knorm))", 8, 1), ("ada(snapkv)", 8, 1), ("h2o", 8, 5)])
def test_policy_greedy_equals_the_runners_closed_loop(llama, ids, spec, budget, chunk):
    """Greedy generate() with a policy (prompt prefilled, streamed or in chunks) gives the tokens of the
    runner's closed loop on the same prompt, and holds what its last step held."""
    pol = parse_policy(spec)
    run = CompressedRunner(llama, pol, budget, chunk=chunk).run(ids[:24], n_generate=14)
    ours = generate(llama, [ids[:24]], pol, budget, max_new_tokens=14, prefill_chunk=chunk)
    new = ours.rows[0].new_tokens
    assert new == _until_eos(llama, run.generated)
    if len(new) == 14:
        assert ours.rows[0].kv_bytes_held == run.kv_bytes[-1]


@pytest.mark.parametrize("sliding", ["keep", "compress"])
def test_gemma3_policy_greedy_equals_the_runners_closed_loop(gemma, ids, sliding):
    run = CompressedRunner(gemma, parse_policy("h2o"), 6, sliding=sliding).run(ids[:16], n_generate=16)
    ours = generate(gemma, [ids[:16]], "h2o", 6, max_new_tokens=16, sliding=sliding)
    assert _tokens(ours)[0] == _until_eos(gemma, run.generated)


def test_open_loop_kept_sets_equal_the_simulators(llama, ids, tmp_path):
    """Open loop (the model's output from the full cache): every kept set of every layer, step and KV head equals
    the simulator's replay of a trace recorded from the same model and tokens."""
    P, n, budget = 16, 16, 8
    pol = parse_policy("snapkv")
    with kvsim_cache(llama, pol, budget, max_new_tokens=n, open_loop=True, record_kept=(P, n - 1)) as cache:
        out = llama.generate(torch.tensor([ids[:P]]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             **{cache_keyword(llama): cache})
    tokens = out[0].tolist()
    assert len(tokens) == P + n
    record_trace(llama, tokens[:P + n - 1], tmp_path / "t", n_prompt=P, n_decode=n - 1, teacher_forced=True,
                 single_pass=True, progress=False)
    sim = replay(load_trace(tmp_path / "t"), pol, budget, record_kept=(P, n - 1), threads=1)
    agree = compare_kept(cache.kept(0)[sim.layer_index], sim.kept, n - 1)
    assert agree["n_compared"] == 2 * (n - 1) * 2 and agree["kept_agreement"] == 1.0


# ----- batches, memory, a forward loop -----

@pytest.mark.parametrize("spec,budget", [("h2o", 6), ("ada(snapkv)", 6), ("decoding(tova, every=3)", 8)])
def test_a_batch_equals_its_rows_run_alone(llama, ids, spec, budget):
    """Prompts of three lengths (two rows share one): each row's tokens and bytes are those of its run alone."""
    prompts = [ids[:20], ids[3:15], ids[6:26], ids[:9]]
    batch = generate(llama, prompts, spec, budget, max_new_tokens=10)
    for p, got in zip(prompts, batch.rows):
        alone = generate(llama, [p], spec, budget, max_new_tokens=10).rows[0]
        assert got.new_tokens == alone.new_tokens
        if len(alone.new_tokens) == 10:              # (a row that ended early decodes on in the batch)
            assert got.kv_bytes_held == alone.kv_bytes_held


@pytest.mark.parametrize("spec", ["h2o", "snapkv", "ada(snapkv)", "decoding(snapkv, every=4)"])
def test_bytes_held_stay_within_the_budget(llama, ids, spec):
    """K+V bytes held <= budget slots per KV head in every layer (a layer's total for head-adaptive Ada-KV),
    well under the full cache's."""
    budget, (L, Hkv, d) = 6, (2, 2, 16)
    res = generate(llama, [ids[:30], ids[:21]], spec, budget, max_new_tokens=8)
    for row in res.rows:
        assert 0 < row.kv_bytes_held <= L * Hkv * budget * 2 * d * 4 < row.kv_bytes_full_cache


def test_a_plain_forward_loop_is_generate(llama, ids):
    """The cache stepped by hand (prompt, then one greedy token per forward) gives generate()'s tokens."""
    want = _tokens(generate(llama, [ids[:18]], "tova", 6, max_new_tokens=9))[0]
    key = cache_keyword(llama)
    with kvsim_cache(llama, "tova", 6, max_new_tokens=9) as cache, torch.no_grad():
        x, got = torch.tensor([ids[:18]]), []
        for _ in range(9):
            tok = int(llama(input_ids=x, **{key: cache}).logits[0, -1].argmax())
            got.append(tok)
            x = torch.tensor([[tok]])
    assert _until_eos(llama, got) == want


# ----- what cannot run -----

def test_unsupported_architectures_are_refused_by_name():
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=101, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    with pytest.raises(ValidateError, match="GPT2LMHeadModel.*'gpt2'"):
        generate(gpt2, [[1, 2, 3]], "full")
    bert = BertForMaskedLM(BertConfig(vocab_size=101, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=32))
    with pytest.raises(ValidateError, match="BertForMaskedLM"):
        with kvsim_cache(bert, "full", max_new_tokens=2):
            pass


def test_misuse_is_refused(llama, ids):
    """Outside its block, for beam search, beyond its max_new_tokens, with right padding, without a budget."""
    key = cache_keyword(llama)
    loose = KVSimCache(llama, "h2o", 8, max_new_tokens=4)
    with pytest.raises(ValidateError, match="inside `with kvsim_cache"):
        llama(input_ids=torch.tensor([ids[:8]]), **{key: loose})
    with kvsim_cache(llama, "h2o", 8, max_new_tokens=4) as cache, pytest.raises(ValidateError, match="beam search"):
        llama.generate(torch.tensor([ids[:8]]), max_new_tokens=4, num_beams=2, **{key: cache})
    with kvsim_cache(llama, "h2o", 8, max_new_tokens=3) as cache, pytest.raises(ValidateError, match="max_new_tok"):
        llama.generate(torch.tensor([ids[:8]]), max_new_tokens=5, eos_token_id=None, **{key: cache})
    with kvsim_cache(llama, "h2o", 8, max_new_tokens=3) as cache, pytest.raises(ValidateError, match="left-padded"):
        llama(input_ids=torch.tensor([ids[:8]]), attention_mask=torch.tensor([[1] * 7 + [0]]), **{key: cache})
    with pytest.raises(ValidateError, match="needs a budget"):
        KVSimCache(llama, "h2o", max_new_tokens=4)


# ----- the real models, when cached -----

def _cached(name: str):
    from traces.models import entry, is_cached, load_model

    if not is_cached(entry(name)):
        pytest.skip(f"{name} is not in the model cache (kvsim models --fetch {name})")
    return load_model(name, progress=False)


def test_smollm2_full_cache_is_transformers_generate():
    from traces.model import read_text

    model, tok = _cached("smollm2-135m")
    prompt = tok(read_text("default")[0], verbose=False)["input_ids"][:48]
    assert _tokens(generate(model, [prompt], "full", max_new_tokens=10)) == _hf_generate(model, [prompt], 10,
                                                                                         do_sample=False)


def test_gemma3_270m_full_cache_past_its_window_is_transformers_generate():
    """Gemma-3-270M's 512-token sliding window: a 530-token prompt, generated on past it."""
    from traces.model import read_text

    model, tok = _cached("gemma3-270m")
    prompt = tok(read_text("default")[0], verbose=False)["input_ids"][:530]
    assert _tokens(generate(model, [prompt], "full", max_new_tokens=6)) == _hf_generate(model, [prompt], 6,
                                                                                        do_sample=False)
