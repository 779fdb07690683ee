"""Varlen decode-attention kernel vs the torch reference (CPU, TRITON_INTERPRET=1; TRITON_INTERPRET=0 on a GPU)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gpu_validate.kvcache.kernels.attention import varlen_decode_attention  # noqa: E402
from gpu_validate.kvcache.kernels.kernel_errors import KernelInputError  # noqa: E402
from gpu_validate.kvcache.kernel_reference import ref_decode_attention  # noqa: E402

DEVICE = "cuda" if os.environ["TRITON_INTERPRET"] == "0" and torch.cuda.is_available() else "cpu"
# one rounding of the output dtype (p is rounded to the value dtype before P@V, as in flash attention)
O_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make_case(lengths, capacity, n_batch, n_kv, group, d, dtype, seed=0, garbage=True):
    """Flat cache with ragged lengths; slots past each head's length hold NaN so any over-read shows."""
    gen = torch.Generator().manual_seed(seed)
    n_heads = n_batch * n_kv
    caps = torch.as_tensor(capacity).expand(n_heads) if isinstance(capacity, int) else torch.as_tensor(capacity)
    start = (torch.cumsum(caps, 0) - caps).to(torch.int32)
    total = int(caps.sum())
    k = torch.randn(total, d, generator=gen).to(dtype)
    v = torch.randn(total, d, generator=gen).to(dtype)
    length = torch.as_tensor(lengths, dtype=torch.int32)
    retained = torch.zeros(total, dtype=torch.bool)
    for i in range(n_heads):
        retained[int(start[i]) : int(start[i]) + int(length[i])] = True
    if garbage:
        k[~retained] = float("nan")
        v[~retained] = float("nan")
    q = torch.randn(n_batch, n_kv * group, d, generator=gen).to(dtype)
    acc = torch.rand(total, generator=gen)
    ema = torch.rand(total, generator=gen)
    return q, k, v, start, length, acc, ema, retained, int(caps.max())


def to_dev(*ts):
    return [t.to(DEVICE) for t in ts]


def check_against_reference(q, k, v, start, length, acc, ema, retained, max_len, *, logit_scale=1.0,
                            softmax_scale=None, gamma=0.9, num_splits=None, block_n=64):
    d = q.shape[-1]
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    ref = ref_decode_attention(q, k, v, start, length, softmax_scale=scale, logit_scale=logit_scale,
                               acc=acc, ema=ema, ema_gamma=gamma)
    qd, kd, vd, sd, ld, ad, ed = to_dev(q, k, v, start, length, acc.clone(), ema.clone())
    probs = torch.full((k.shape[0], ref.probs.shape[1]), -7.0, device=DEVICE)
    out = varlen_decode_attention(qd, kd, vd, sd, ld, max_len=max_len, softmax_scale=softmax_scale,
                                  logit_scale=logit_scale, probs=probs, acc=ad, ema=ed, ema_gamma=gamma,
                                  num_splits=num_splits, block_n=block_n)
    tol = O_TOL[q.dtype]
    torch.testing.assert_close(out.o.float().cpu(), ref.o.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(out.lse.cpu(), ref.lse, atol=1e-5, rtol=1e-5)
    p = out.probs.cpu()
    torch.testing.assert_close(p[retained], ref.probs[retained], atol=1e-6, rtol=1e-5)
    assert bool((p[~retained] == -7.0).all()), "kernel wrote scores outside retained slots"
    torch.testing.assert_close(ad.cpu()[retained], ref.acc[retained], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ed.cpu()[retained], ref.ema[retained], atol=1e-6, rtol=1e-5)
    assert torch.equal(ad.cpu()[~retained], acc[~retained]) and torch.equal(ed.cpu()[~retained], ema[~retained])
    return out, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_ragged_lengths_all_dtypes(dtype, d, num_splits):
    case = make_case([1, 7, 64, 300], 320, n_batch=2, n_kv=2, group=4, d=d, dtype=dtype, seed=d)
    check_against_reference(*case, num_splits=num_splits)


@pytest.mark.parametrize("group", [1, 3, 8])
def test_group_sizes(group):
    case = make_case([300, 1, 7, 64], [300, 8, 8, 100], n_batch=1, n_kv=4, group=group, d=64,
                     dtype=torch.float16, seed=group)
    check_against_reference(*case, num_splits=2, logit_scale=1.7, gamma=0.5)


def test_long_head_4096_split_k():
    case = make_case([4096, 3], [4096, 64], n_batch=1, n_kv=2, group=2, d=64, dtype=torch.float16, seed=5)
    check_against_reference(*case, block_n=128)
    check_against_reference(*case, num_splits=7, block_n=128)


def test_many_splits_exceed_one_reduce_block():
    case = make_case([600], 600, n_batch=1, n_kv=1, group=4, d=64, dtype=torch.float32, seed=9)
    check_against_reference(*case, num_splits=38, block_n=16)


def test_empty_head_gives_zero_output_and_minus_inf_lse():
    case = make_case([0, 5], 16, n_batch=1, n_kv=2, group=2, d=64, dtype=torch.float32)
    out, _ = check_against_reference(*case)
    assert torch.equal(out.o[0, :2].cpu(), torch.zeros(2, 64))
    assert bool(torch.isneginf(out.lse[0, :2]).all())


def test_probabilities_sum_to_one_and_custom_softmax_scale():
    q, k, v, start, length, acc, ema, retained, max_len = make_case([33, 64], 64, 1, 2, 4, 64, torch.float32)
    out, _ = check_against_reference(q, k, v, start, length, acc, ema, retained, max_len, softmax_scale=0.3,
                                      logit_scale=0.5)
    for i in range(2):
        s0 = int(start[i])
        sums = out.probs[s0 : s0 + int(length[i])].sum(0).cpu()
        torch.testing.assert_close(sums, torch.ones(4), atol=1e-5, rtol=0)


def test_scores_off_and_statistics_only():
    q, k, v, start, length, acc, ema, retained, max_len = make_case([20, 90], 96, 1, 2, 2, 64, torch.float16)
    ref = ref_decode_attention(q, k, v, start, length, softmax_scale=64**-0.5, acc=acc)
    qd, kd, vd, sd, ld, ad = to_dev(q, k, v, start, length, acc.clone())
    plain = varlen_decode_attention(qd, kd, vd, sd, ld, max_len=max_len, want_probs=False)
    assert plain.probs is None
    torch.testing.assert_close(plain.o.float().cpu(), ref.o.float(), atol=2e-3, rtol=2e-3)
    scratch = torch.full((k.shape[0], 2), -7.0, device=DEVICE)
    stats = varlen_decode_attention(qd, kd, vd, sd, ld, want_probs=False, acc=ad, probs=scratch)
    assert stats.probs is None
    assert not bool((scratch.cpu()[retained] == -7.0).any()), "logits should be in the scratch buffer"
    assert not torch.allclose(scratch.cpu()[retained].sum(0), torch.ones(2)), "probs were written back"
    torch.testing.assert_close(ad.cpu()[retained], ref.acc[retained], atol=1e-6, rtol=1e-5)


@settings(max_examples=20, deadline=None)
@given(
    n_batch=st.integers(1, 2),
    n_kv=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    d=st.sampled_from([16, 32, 64]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    data=st.data(),
)
def test_random_shapes_match_reference(n_batch, n_kv, group, d, dtype, data):
    n_heads = n_batch * n_kv
    caps = data.draw(st.lists(st.integers(1, 200), min_size=n_heads, max_size=n_heads))
    lengths = [data.draw(st.integers(0, c)) for c in caps]
    splits = data.draw(st.sampled_from([None, 1, 2, 5]))
    block_n = data.draw(st.sampled_from([16, 32, 64]))
    case = make_case(lengths, caps, n_batch, n_kv, group, d, dtype, seed=data.draw(st.integers(0, 10**6)))
    check_against_reference(*case, num_splits=splits, block_n=block_n, gamma=data.draw(st.floats(0.0, 1.0)))


def test_bad_inputs_raise_clear_errors():
    q, k, v, start, length, *_ = make_case([4, 4], 8, 1, 2, 2, 16, torch.float16)
    with pytest.raises(KernelInputError, match="k_cache dtype"):
        varlen_decode_attention(q, k.float(), v, start, length)
    with pytest.raises(KernelInputError, match="start"):
        varlen_decode_attention(q, k, v, start.long(), length)
    with pytest.raises(KernelInputError, match="multiple of Hkv"):
        varlen_decode_attention(q[:, :3], k, v, start, length)
    with pytest.raises(KernelInputError, match="ema_gamma"):
        varlen_decode_attention(q, k, v, start, length, ema=torch.zeros(16), ema_gamma=1.5)
    with pytest.raises(KernelInputError, match="block_n"):
        varlen_decode_attention(q, k, v, start, length, block_n=24)
    with pytest.raises(KernelInputError, match="num_splits"):
        varlen_decode_attention(q, k, v, start, length, num_splits=0)
    with pytest.raises(KernelInputError, match="probs"):
        varlen_decode_attention(q, k, v, start, length, probs=torch.zeros(16, 3))
