"""In-place compaction kernel (keep masks, merges, appends) vs the torch reference, CPU under TRITON_INTERPRET=1."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gpu_validate.kvcache.kernels.compaction import slot_heads, varlen_compact  # noqa: E402
from gpu_validate.kvcache.kernels.kernel_errors import CacheCapacityError, KernelInputError  # noqa: E402
from gpu_validate.kvcache.kernel_reference import ref_compact  # noqa: E402

DEVICE = "cuda" if os.environ["TRITON_INTERPRET"] == "0" and torch.cuda.is_available() else "cpu"
# merged rows are rounded once from fp32; allow one unit in the last place of the cache dtype
MERGE_RTOL = {torch.float32: 1e-6, torch.float16: 2**-10, torch.bfloat16: 2**-7}


def make_cache(caps, lengths, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    caps_t = torch.as_tensor(caps, dtype=torch.int32)
    start = (torch.cumsum(caps_t, 0) - caps_t).to(torch.int32)
    total = int(caps_t.sum())
    return dict(
        k_cache=torch.randn(total, d, generator=gen).to(dtype),
        v_cache=torch.randn(total, d, generator=gen).to(dtype),
        start=start,
        length=torch.as_tensor(lengths, dtype=torch.int32),
        capacity=caps_t,
        positions=torch.randperm(10 * total + 1, generator=gen)[:total],
        acc=torch.rand(total, generator=gen),
        ema=torch.rand(total, generator=gen),
    )


def random_ops(cache, p_keep, p_merge, n_new, seed):
    """Random keep mask, merges of evicted slots into random kept slots of their head, and new tokens."""
    gen = torch.Generator().manual_seed(seed)
    total, d = cache["k_cache"].shape
    n_heads = cache["start"].numel()
    keep = torch.rand(total, generator=gen) < p_keep
    merge_to = torch.full((total,), -1, dtype=torch.int32)
    merge_w = torch.rand(total, generator=gen) + 0.1
    for i in range(n_heads):
        s0, n = int(cache["start"][i]), int(cache["length"][i])
        kept = torch.nonzero(keep[s0 : s0 + n]).flatten()
        if kept.numel() == 0:
            continue
        for e in torch.nonzero(~keep[s0 : s0 + n]).flatten().tolist():
            if float(torch.rand(1, generator=gen)) < p_merge:
                merge_to[s0 + e] = int(kept[torch.randint(kept.numel(), (1,), generator=gen)])
    ops = dict(keep=keep, merge_to=merge_to, merge_w=merge_w)
    if n_new:
        ops["k_new"] = torch.randn(n_heads, n_new, d, generator=gen).to(cache["k_cache"].dtype)
        ops["v_new"] = torch.randn(n_heads, n_new, d, generator=gen).to(cache["k_cache"].dtype)
        ops["new_positions"] = torch.randint(0, 10**6, (n_heads, n_new), generator=gen)
    return ops


def run_both(cache, ops, block_n=128):
    """Apply ops with the reference (copies) and the kernel (in place on device copies); compare retained rows."""
    ref = ref_compact(**cache, **ops)
    dev = {name: t.clone().to(DEVICE) for name, t in cache.items()}
    dev_ops = {name: t.to(DEVICE) for name, t in ops.items()}
    if "merge_to" in ops:
        dev_ops["slot_owner"] = slot_heads(dev["start"], dev["capacity"], dev["k_cache"].shape[0])
    varlen_compact(**dev, **dev_ops, block_n=block_n)
    assert torch.equal(dev["length"].cpu(), ref.length)
    rtol = MERGE_RTOL[cache["k_cache"].dtype]
    for i in range(cache["start"].numel()):
        rows = slice(int(cache["start"][i]), int(cache["start"][i]) + int(ref.length[i]))
        for name, want in (("k_cache", ref.k), ("v_cache", ref.v)):
            torch.testing.assert_close(dev[name].cpu()[rows].float(), want[rows].float(), rtol=rtol, atol=1e-6)
        for name, want in (("positions", ref.positions), ("acc", ref.acc), ("ema", ref.ema)):
            assert torch.equal(dev[name].cpu()[rows], want[rows]), name
    return dev, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
def test_keep_merge_append_matches_reference(dtype, d):
    cache = make_cache([300, 8, 64, 320], [1, 7, 64, 300], d, dtype, seed=d)
    run_both(cache, random_ops(cache, p_keep=0.6, p_merge=0.7, n_new=2, seed=d + 1))


def test_merge_arithmetic_worked_example():
    """x_j <- w_j x_j + sum_e w_e x_e for one target with two sources; the untargeted kept slot is unchanged."""
    cache = make_cache([4], [4], 16, torch.float32, seed=0)
    k = torch.arange(4, dtype=torch.float32)[:, None].expand(4, 16).contiguous() + 1.0  # rows 1,2,3,4
    cache["k_cache"], cache["v_cache"] = k.clone(), 10 * k
    ops = dict(keep=torch.tensor([True, False, True, False]), merge_to=torch.tensor([-1, 2, -1, 2], dtype=torch.int32),
               merge_w=torch.tensor([0.0, 0.25, 0.5, 0.125]))
    dev, _ = run_both(cache, ops)
    assert dev["length"].tolist() == [2]
    assert torch.equal(dev["k_cache"][0], torch.full((16,), 1.0, device=DEVICE))  # w of untargeted slot ignored
    assert torch.equal(dev["k_cache"][1].cpu(), torch.full((16,), 0.5 * 3 + 0.25 * 2 + 0.125 * 4))
    assert torch.equal(dev["v_cache"][1].cpu(), torch.full((16,), 10 * (0.5 * 3 + 0.25 * 2 + 0.125 * 4)))


def test_append_only_and_single_eviction_skip_path():
    cache = make_cache([200, 200], [150, 0], 64, torch.float16, seed=3)
    ops = random_ops(cache, p_keep=1.0, p_merge=0.0, n_new=3, seed=4)
    append = {k: v for k, v in ops.items() if k in ("k_new", "v_new", "new_positions")}
    run_both(cache, append, block_n=32)
    keep = torch.ones(400, dtype=torch.bool)
    keep[140] = False  # a single eviction late in head 0: the first tiles are identity and skipped
    run_both(cache, dict(keep=keep), block_n=32)


def test_long_head_4096():
    cache = make_cache([4096, 16], [4096, 9], 64, torch.float16, seed=7)
    run_both(cache, random_ops(cache, p_keep=0.9, p_merge=0.3, n_new=1, seed=8), block_n=256)


def test_capacity_overflow_compacts_but_does_not_append():
    cache = make_cache([8, 8], [8, 3], 16, torch.float32, seed=1)
    keep = torch.ones(16, dtype=torch.bool)
    keep[0] = False
    d = {name: t.clone().to(DEVICE) for name, t in cache.items()}
    new = torch.ones(2, 2, 16, device=DEVICE)
    with pytest.raises(CacheCapacityError, match=r"heads \[0\]"):
        varlen_compact(**d, keep=keep.to(DEVICE), k_new=new, v_new=new)
    assert d["length"].tolist() == [7, 5]
    with pytest.raises(CacheCapacityError):
        ref_compact(**cache, keep=keep, k_new=new.cpu(), v_new=new.cpu())


def test_merge_into_evicted_slot_is_rejected():
    cache = make_cache([4], [4], 16, torch.float32, seed=0)
    ops = dict(keep=torch.tensor([True, False, False, True]), merge_to=torch.tensor([-1, 2, -1, -1], dtype=torch.int32),
               merge_w=torch.ones(4))
    with pytest.raises(KernelInputError, match="merges? into"):
        ref_compact(**cache, **ops)
    d = {name: t.clone().to(DEVICE) for name, t in cache.items()}
    owner = slot_heads(d["start"], d["capacity"], 4)
    with pytest.raises(KernelInputError, match="merges? into"):
        varlen_compact(**d, **{k: v.to(DEVICE) for k, v in ops.items()}, slot_owner=owner)
    with pytest.raises(KernelInputError, match="keep must be"):
        varlen_compact(**d, keep=torch.ones(5, dtype=torch.bool, device=DEVICE))


@settings(max_examples=25, deadline=None)
@given(
    n_heads=st.integers(1, 4),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    p_keep=st.sampled_from([0.0, 0.3, 0.8, 1.0]),
    p_merge=st.sampled_from([0.0, 0.5, 1.0]),
    block_n=st.sampled_from([16, 32, 128]),
    data=st.data(),
)
def test_random_compactions_match_reference(n_heads, dtype, p_keep, p_merge, block_n, data):
    caps = data.draw(st.lists(st.integers(1, 150), min_size=n_heads, max_size=n_heads))
    lengths = [data.draw(st.integers(0, c)) for c in caps]
    cache = make_cache(caps, lengths, 32, dtype, seed=data.draw(st.integers(0, 10**6)))
    # n_new must fit in every head even when all slots are kept
    n_new = data.draw(st.integers(0, min(c - n for c, n in zip(caps, lengths))))
    ops = random_ops(cache, p_keep, p_merge, n_new, seed=data.draw(st.integers(0, 10**6)))
    if data.draw(st.booleans()):
        ops.pop("merge_to"), ops.pop("merge_w")
    if data.draw(st.booleans()):
        ops["keep"] = ops["keep"].to(torch.uint8)
    run_both(cache, ops, block_n=block_n)
