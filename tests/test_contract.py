"""The step contract (sim/replay/contract.py) is one set of checks: the engine, the numpy reference and the closed-loop
runner reject the same broken policies with the same PolicyContractError and message."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from numba import njit

from gpu_validate.closedloop.runner import CompressedRunner
from policies.core.base import LOGIT_SCALE_SIG, STEP_SIG, Policy, PolicyError
from policies.core.registry import get_policy
from sim.replay.contract import (BAD_MERGE, BAD_SCALE, OK, OVER_BUDGET, PolicyContractError, check_allocation, check_kept,
                          check_merges, check_scale, check_step, contract_error, slot_capacity)
from sim.replay.numpy_reference import reference_replay_layer
from sim.replay.layer_inputs import load_layers
from sim.replay.policy_replay import replay
from traces.synthetic import make_synthetic_trace


def test_contract_error_is_a_policy_error():
    assert issubclass(PolicyContractError, PolicyError)


@pytest.mark.parametrize("name,budgets,n,expect", [
    ("h2o", [4, 6], 100, [5, 7]),            # budget + 1: the new token arrives before the eviction
    ("h2o", [4, 6], 5, [5, 5]),              # never more than the tokens the run has
    ("ada_h2o", [4, 6], 100, [11, 11]),      # head-adaptive: any head may hold the layer's total
    ("full", [4, 6], 37, [37, 37]),          # unbounded: every token
])
def test_slot_capacity(name, budgets, n, expect):
    assert slot_capacity(get_policy(name), np.array(budgets), n).tolist() == expect


def test_check_allocation_shapes_and_values():
    pol = get_policy("h2o")
    out = check_allocation(pol, [[3, 4], [5, 6]], 2, 2)
    assert out.dtype == np.int64 and out.flags.c_contiguous and out.tolist() == [[3, 4], [5, 6]]
    with pytest.raises(PolicyContractError, match=r"shape \(2,\).*need \(2, 2\)"):
        check_allocation(pol, [3, 4], 2, 2)
    with pytest.raises(PolicyContractError, match="smallest 0"):
        check_allocation(pol, [[3, 0], [5, 6]], 2, 2)
    with pytest.raises(PolicyContractError, match="not integer budgets"):
        check_allocation(pol, [["a", "b"]], 1, 2)


def test_jitted_checks():
    info = np.zeros(3, np.int64)
    assert check_scale(1.5, 7, info) == OK
    assert check_scale(np.nan, 7, info) == BAD_SCALE and info[0] == 7
    assert check_scale(0.0, 7, info) == BAD_SCALE
    budget = np.array([2, 2])
    assert check_kept(np.array([2, 2]), budget, False, True, 3, info) == OK
    assert check_kept(np.array([1, 3]), budget, False, True, 3, info) == OVER_BUDGET and info.tolist() == [3, 1, 3]
    assert check_kept(np.array([1, 3]), budget, True, True, 3, info) == OK          # the layer holds 4 <= 4
    assert check_kept(np.array([2, 3]), budget, True, True, 4, info) == OVER_BUDGET and info.tolist() == [4, -1, 5]
    assert check_kept(np.array([9, 9]), budget, False, False, 4, info) == OK        # unbounded
    keep = np.array([[0, 1, 1]], np.uint8)
    for target, ok in [(1, True), (0, False), (2, True), (3, False)]:
        mt = np.array([[target, -1, -1]], np.int64)
        assert (check_merges(0, 3, keep, mt, 5, info) == OK) == ok
    mt = np.array([[-1, 2, -1]], np.int64)        # a kept slot cannot merge away
    assert check_merges(0, 3, keep, mt, 5, info) == BAD_MERGE and info.tolist() == [5, 0, 1]
    # check_step: merges first, then the kept count against the budget
    lengths = np.array([3], np.int64)
    assert check_step(lengths, np.ones((1, 3), np.uint8), np.full((1, 3), -1, np.int64), np.array([2]), False, True,
                      6, info) == OVER_BUDGET
    assert check_step(lengths, keep, np.full((1, 3), -1, np.int64), np.array([2]), False, True, 6, info) == OK


def test_contract_error_message():
    err = contract_error(get_policy("h2o"), OVER_BUDGET, [12, 1, 9], 3)
    assert isinstance(err, PolicyContractError)
    assert str(err) == "policy h2o broke its contract at layer 3, step 12: holds 9 slots in KV head 1, over its budget"
    assert "prefill" in str(contract_error(get_policy("h2o"), BAD_SCALE, [-1, 0, 0], 0))


@njit(STEP_SIG, cache=True)
def _keep_all_step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state, head_state, keep,
                   merge_to, merge_w):
    return


@njit(STEP_SIG, cache=True)
def _merge_into_evicted_step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state,
                             head_state, keep, merge_to, merge_w):
    for h in range(lengths.shape[0]):
        if lengths[h] > budget[h]:
            keep[h, 0] = 0
            keep[h, 1] = 0
            merge_to[h, 0] = 1          # into a slot that is evicted too


@njit(STEP_SIG, cache=True)
def _evict_oldest_step(params, layer, t, budget, lengths, probs, keys, values, positions, slot_state, head_state,
                       keep, merge_to, merge_w):
    for h in range(lengths.shape[0]):
        if lengths[h] > budget[h]:
            keep[h, 0] = 0


@njit(LOGIT_SCALE_SIG, cache=True)
def _negative_scale(params, n):
    return -1.0 if n > 20 else 1.0


class _KeepAll(Policy):
    name = "keep_all_bounded"
    step_fn = _keep_all_step


class _BadMerge(Policy):
    name = "bad_merge"
    step_fn = _merge_into_evicted_step

    def min_budget(self) -> int:
        return 2


class _BadScale(Policy):
    name = "bad_scale"
    step_fn = _evict_oldest_step
    logit_scale_fn = _negative_scale


class _BadAllocate(Policy):
    name = "bad_allocate"
    step_fn = _evict_oldest_step

    def allocate(self, budget, n_kv_heads, prompt_layers, scale):
        return np.full((len(prompt_layers), n_kv_heads + 1), budget)


BROKEN = [(_KeepAll, "step 4: holds 5 slots in KV head 0, over its budget"),
          (_BadMerge, "step 4: KV head 0 slot 0 has a merge target"),
          (_BadScale, "step 20: returned a non-finite or non-positive attention-logit scale")]


@pytest.fixture(scope="module")
def tiny():
    return make_synthetic_trace("mixed", n_tokens=32, n_prompt=8, n_layers=1, n_q_heads=2, n_kv_heads=1, head_dim=16,
                                seed=0)


@pytest.mark.parametrize("cls,message", BROKEN, ids=[c.name for c, _ in BROKEN])
def test_engine_and_reference_reject_alike(tiny, cls, message):
    budget = 4
    with pytest.raises(PolicyContractError, match=message) as engine:
        replay(tiny, cls(), budget)
    li = load_layers(tiny)[0]
    with pytest.raises(PolicyContractError) as reference:
        reference_replay_layer(cls(), 0, li, np.full(1, budget, np.int64), tiny.meta.n_prompt,
                               tiny.meta.softmax_scale)
    assert str(reference.value) == str(engine.value)


def test_bad_allocation_rejected_by_engine(tiny):
    with pytest.raises(PolicyContractError, match=r"allocate\(\) returned budgets of shape \(1, 2\)"):
        replay(tiny, _BadAllocate(), 4)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("cls,message", BROKEN + [(_BadAllocate, r"allocate\(\) returned budgets of shape \(1, 2\)")],
                         ids=[c.name for c, _ in BROKEN] + ["bad_allocate"])
def test_closed_loop_runner_rejects_alike(cls, message):
    ids = torch.randint(0, 101, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    with pytest.raises(PolicyContractError, match=message):
        CompressedRunner(_llama(), cls(), 4).run(ids[:8], continuation=ids[8:])
