"""VarlenKVCache end to end: prefill, append, attend, evict/merge over several decode steps vs a list model."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from gpu_validate.kvcache.varlen_cache import VarlenKVCache  # noqa: E402
from gpu_validate.kvcache.kernels.kernel_errors import CacheCapacityError, KernelInputError  # noqa: E402

DEVICE = "cuda" if os.environ["TRITON_INTERPRET"] == "0" and torch.cuda.is_available() else "cpu"


class ListModel:
    """Per head python lists of (position, k, v, acc) rows in fp32: the obvious semantics of the cache."""

    def __init__(self, k, v, keep):
        bsz, n_kv, t_len, _ = k.shape
        self.heads = [
            [[p, k[b, h, p].float(), v[b, h, p].float(), 0.0] for p in range(t_len) if keep[b, h, p]]
            for b in range(bsz) for h in range(n_kv)
        ]

    def attend(self, q, group, scale):
        n_kv = len(self.heads) // q.shape[0]
        o = torch.zeros(q.shape)
        for i, rows in enumerate(self.heads):
            b, h = divmod(i, n_kv)
            kk = torch.stack([r[1] for r in rows])
            vv = torch.stack([r[2] for r in rows])
            p = torch.softmax(q[b, h * group : (h + 1) * group].float() @ kk.T * scale, dim=1)
            o[b, h * group : (h + 1) * group] = p @ vv
            for r, ps in zip(rows, p.sum(0).tolist()):
                r[3] += ps
        return o


def test_closed_loop_decode_with_eviction_and_merges():
    torch.manual_seed(0)
    bsz, n_kv, group, d, t_len = 2, 2, 2, 32, 24
    budgets = [16, 12, 20, 9]
    cache = VarlenKVCache(batch=bsz, n_kv_heads=n_kv, n_q_heads=n_kv * group, head_dim=d, capacity=budgets,
                          dtype=torch.float32, device=DEVICE, track_acc=True, track_ema=True, ema_gamma=0.8)
    k = torch.randn(bsz, n_kv, t_len, d)
    v = torch.randn(bsz, n_kv, t_len, d)
    keep = torch.zeros(bsz * n_kv, t_len, dtype=torch.bool)
    for i, budget in enumerate(budgets):  # ragged prefill selections, each 3 short of the head's budget
        keep[i, torch.randperm(t_len)[: budget - 3]] = True
    keep = keep.view(bsz, n_kv, t_len)
    cache.prefill(k.to(DEVICE), v.to(DEVICE), keep.to(DEVICE))
    model = ListModel(k, v, keep)
    n_evicted = 0
    assert cache.lengths.flatten().tolist() == [len(r) for r in model.heads]
    for step in range(6):
        pos = t_len + step
        kn, vn = torch.randn(bsz, n_kv, 1, d), torch.randn(bsz, n_kv, 1, d)
        cache.append(kn.to(DEVICE), vn.to(DEVICE), torch.full((bsz, 1), pos, device=DEVICE))
        for i, rows in enumerate(model.heads):
            rows.append([pos, kn.reshape(-1, d)[i].float(), vn.reshape(-1, d)[i].float(), 0.0])
        q = torch.randn(bsz, n_kv * group, d)
        o, probs = cache.attend(q.to(DEVICE))
        torch.testing.assert_close(o.cpu(), model.attend(q, group, d**-0.5), atol=1e-5, rtol=1e-5)
        # H2O-like policy on host: evict the lowest-acc slot of each full head; odd steps merge it (D2O-like)
        keep_mask = torch.ones(cache.total_capacity, dtype=torch.bool)
        merge_to = torch.full((cache.total_capacity,), -1, dtype=torch.int32)
        merge_w = torch.ones(cache.total_capacity)
        for i, rows in enumerate(model.heads):
            b, h = divmod(i, n_kv)
            sl = cache.head_slice(b, h)
            acc = cache.acc[sl].cpu()
            torch.testing.assert_close(acc, torch.tensor([r[3] for r in rows]), atol=1e-5, rtol=1e-5)
            assert cache.positions[sl].cpu().tolist() == [r[0] for r in rows]
            if len(rows) < budgets[i]:
                continue
            e = int(torch.argmin(acc))
            keep_mask[sl.start + e] = False
            n_evicted += 1
            if step % 2 and len(rows) > 1:
                j = 0 if e != 0 else 1
                merge_to[sl.start + e], merge_w[sl.start + e], merge_w[sl.start + j] = j, 0.25, 0.75
                rows[j][1] = 0.75 * rows[j][1] + 0.25 * rows[e][1]
                rows[j][2] = 0.75 * rows[j][2] + 0.25 * rows[e][2]
            del rows[e]
        cache.compact(keep_mask.to(DEVICE), merge_to.to(DEVICE), merge_w.to(DEVICE))
        assert cache.lengths.flatten().tolist() == [len(r) for r in model.heads]
        assert probs is cache.probs
    assert n_evicted >= 8
    o, probs = cache.attend(torch.randn(bsz, n_kv * group, d, device=DEVICE))
    per_head = cache.padded(probs).transpose(1, 2).cpu()  # [B*Hkv, G, max_capacity], the policies' layout
    pos = cache.padded(cache.positions, -1).cpu()
    for i, rows in enumerate(model.heads):
        assert pos[i, : len(rows)].tolist() == [r[0] for r in rows] and bool((pos[i, len(rows):] == -1).all())
        torch.testing.assert_close(per_head[i, :, : len(rows)].sum(1), torch.ones(group), atol=1e-5, rtol=0)
        assert bool((per_head[i, :, len(rows):] == 0).all())
    n_slots = sum(len(r) for r in model.heads)
    assert cache.memory_bytes() == n_slots * 2 * d * 4
    assert cache.memory_bytes(include_side=True) == n_slots * (2 * d * 4 + 8 + 8)


def test_log_n_logit_scale_changes_attention_like_a_temperature():
    cache = VarlenKVCache(batch=1, n_kv_heads=1, n_q_heads=1, head_dim=16, capacity=8, dtype=torch.float32,
                          device=DEVICE)
    kv = torch.randn(1, 1, 8, 16, device=DEVICE)
    cache.prefill(kv, kv)
    q = torch.randn(1, 1, 16, device=DEVICE)
    _, p1 = cache.attend(q, logit_scale=2.0)
    want = torch.softmax((kv[0, 0] @ q[0, 0]) * 2.0 / 4.0, 0)
    torch.testing.assert_close(p1[:, 0], want, atol=1e-6, rtol=1e-5)


def test_errors_name_the_problem():
    with pytest.raises(KernelInputError, match="capacity"):
        VarlenKVCache(batch=1, n_kv_heads=2, n_q_heads=2, head_dim=16, capacity=[4, 4, 4], device=DEVICE)
    with pytest.raises(KernelInputError, match="multiple"):
        VarlenKVCache(batch=1, n_kv_heads=2, n_q_heads=3, head_dim=16, capacity=4, device=DEVICE)
    cache = VarlenKVCache(batch=1, n_kv_heads=1, n_q_heads=1, head_dim=16, capacity=2, dtype=torch.float32,
                          device=DEVICE, track_acc=False)
    x = torch.zeros(1, 1, 2, 16, device=DEVICE)
    cache.append(x, x)
    with pytest.raises(CacheCapacityError, match="capacity"):
        cache.append(x[:, :, :1], x[:, :, :1])
    with pytest.raises(KernelInputError, match="k_new"):
        cache.append(x[0], x[0])
    with pytest.raises(KernelInputError, match="track"):
        cache.attend(torch.zeros(1, 1, 16, device=DEVICE), update_acc=True)
    with pytest.raises(CacheCapacityError, match="prefill"):
        VarlenKVCache(batch=1, n_kv_heads=1, n_q_heads=1, head_dim=16, capacity=1, device=DEVICE).prefill(x, x)
