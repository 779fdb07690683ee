"""The attention of one KV head's G query heads over its cached slots, the engine's inner loop (sim.replay.engine).

q.k in float32 blocks of eight keys x up to three heads (sixteen keys for a lone head), each key loaded once for
the heads and the keys' 16-lane partial sums reduced together; p.v with the heads' output slices held in registers
over the slots, float32 sums over blocks of 256 slots added into float64 (the softmax between them:
`sim.replay.softmax_kernels`). The q.k and p.v kernels are LLVM vector IR (numba intrinsics; d % 16 == 0, numba loops
otherwise): numba's own loops reload the outputs at every slot (no alias information) and reduce each dot product
on its own.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_VECTOR_MATH = {"reassoc", "contract"}   # lets LLVM vectorise the float32 dot products and sums


# ---------------------------------------------------------------- explicit SIMD kernels (LLVM vector IR)
# q.k and p.v over the head dimension in 16-lane vectors (any x86 or ARM target: LLVM splits them into the
# machine's registers), written as LLVM IR through numba intrinsics because numba's loops cannot say what they
# need: p.v keeps the G heads' output slices in registers over all the slots (LLVM cannot prove that the output
# array does not alias the cache, so a loop reloads and stores them at every slot), and q.k reduces the 16-lane
# partial sums of eight keys together (``_transpose_sum``: 2.9 shuffles and adds per dot instead of a horizontal
# reduction of its own). Used when d % 16 == 0; the numba loops below do the rest (other d, the last keys).

_F32 = ir.FloatType()
_V16 = ir.VectorType(_F32, 16)
_I64 = ir.IntType(64)
_I32 = ir.IntType(32)


def _i64(v):
    return ir.Constant(_I64, v)


def _row_ptr(context, builder, aryty, ary, idx):
    """(pointer to ary[idx..., 0], shape) of a C-contiguous array; idx: the leading indices (i64 values)."""
    a = context.make_array(aryty)(context, builder, ary)
    shape = cgutils.unpack_tuple(builder, a.shape, aryty.ndim)
    off = _i64(0)
    for dim, i in enumerate(idx):
        off = builder.add(builder.mul(off, shape[dim]), i)
    for dim in range(len(idx), aryty.ndim):
        off = builder.mul(off, shape[dim])
    return builder.gep(a.data, [off]), shape


def _vload(builder, fptr, off):
    return builder.load(builder.bitcast(builder.gep(fptr, [off]), _V16.as_pointer()), align=4)


def _vstore(builder, val, fptr, off):
    builder.store(val, builder.bitcast(builder.gep(fptr, [off]), val.type.as_pointer()), align=4)


def _shuf(builder, a, b, mask):
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, len(mask)), mask))


def _llvm_fn(builder, name, ty, n_args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty] * n_args), name)


def _vfma(builder, a, b, c):
    return builder.call(_llvm_fn(builder, "llvm.fma.v16f32", _V16, 3), [a, b, c])


_HALVES = ([*range(0, 8), *range(16, 24)], [*range(8, 16), *range(24, 32)])                 # 256-bit halves
_QUARTERS = ([0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27],                    # 128-bit lanes
             [4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31])
_PAIRS = ([0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29],                         # float pairs
          [2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31])
_SWAP = [j ^ 1 for j in range(16)]


def _combine(builder, a, b, masks):
    return builder.fadd(_shuf(builder, a, b, masks[0]), _shuf(builder, a, b, masks[1]))


def _transpose_sum(builder, vs):
    """8 or 16 vectors of 16 partial sums -> the vector of their sums, [len(vs)] (lane j: the sum of vs[j])."""
    if len(vs) == 16:
        for masks in (_HALVES, _QUARTERS, _PAIRS):
            half = len(vs) // 2
            vs = [_combine(builder, vs[k], vs[k + half], masks) for k in range(half)]
        s0 = builder.fadd(vs[0], _shuf(builder, vs[0], vs[0], _SWAP))     # keys 0, 2, .., 14, in float pairs
        s1 = builder.fadd(vs[1], _shuf(builder, vs[1], vs[1], _SWAP))     # keys 1, 3, .., 15
        return _shuf(builder, s0, s1, [j if j % 2 == 0 else 16 + j for j in range(16)])
    w = [_combine(builder, vs[k], vs[k + 4], _HALVES) for k in range(4)]    # keys k and k + 4
    x = [_combine(builder, w[k], w[k + 2], _QUARTERS) for k in range(2)]    # keys k, k + 2, k + 4, k + 6
    y = _combine(builder, x[0], x[1], _PAIRS)                               # keys 0..7 in float pairs
    y = builder.fadd(y, _shuf(builder, y, y, _SWAP))
    return _shuf(builder, y, y, list(range(0, 16, 2)))


def _hmax(builder, v):
    """The largest lane of a float32 vector (8 or 16 lanes)."""
    n = v.type.count
    fn = _llvm_fn(builder, f"llvm.maxnum.v{n}f32", v.type, 2)
    w = n // 2
    while w >= 1:
        v = builder.call(fn, [v, _shuf(builder, v, v, [(j + w) % n for j in range(n)])])
        w //= 2
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _f32_c_arrays(*arrays):
    return all(isinstance(a, types.Array) and a.layout == "C" and a.dtype == types.float32 for a in arrays)


def _make_qk(n_heads, n_keys):
    """The intrinsic qk(q, t, hq, ck, h, b, i0, dots, g): dots[g + j, i0:i0 + n_keys] = q[t, hq + j] . ck[h, b + i0:...]
    for j < n_heads (float32, d % 16 == 0). Each key's 16-lane chunk is loaded once for the heads (n_heads * n_keys
    partial sums held in registers over d), then the keys' partial sums are reduced together (``_transpose_sum``)."""
    @intrinsic
    def qk(typingctx, q, t, hq, ck, h, b, i0, dots, g):
        if not _f32_c_arrays(q, ck, dots):
            return None
        sig = types.void(q, types.int64, types.int64, ck, types.int64, types.int64, types.int64, dots, types.int64)

        def codegen(context, builder, signature, args):
            qv, tv, hqv, ckv, hv, bv, i0v, dotsv, gv = args
            qp, qshape = _row_ptr(context, builder, signature.args[0], qv, [tv, hqv])
            kp, _ = _row_ptr(context, builder, signature.args[3], ckv, [hv, builder.add(bv, i0v)])
            dp, dshape = _row_ptr(context, builder, signature.args[7], dotsv, [gv])
            d = qshape[2]
            zero = ir.Constant(_V16, [0.0] * 16)
            accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(n_keys)] for _ in range(n_heads)]
            with cgutils.for_range(builder, builder.udiv(d, _i64(16))) as loop:
                x = builder.mul(loop.index, _i64(16))
                qc = [_vload(builder, qp, builder.add(builder.mul(_i64(j), d), x)) for j in range(n_heads)]
                for i in range(n_keys):
                    kc = _vload(builder, kp, builder.add(builder.mul(_i64(i), d), x))
                    for j in range(n_heads):
                        builder.store(_vfma(builder, qc[j], kc, builder.load(accs[j][i])), accs[j][i])
            for j in range(n_heads):
                out = _transpose_sum(builder, [builder.load(a) for a in accs[j]])
                _vstore(builder, out, dp, builder.add(builder.mul(_i64(j), dshape[1]), i0v))
            return context.get_dummy_value()

        return sig, codegen
    return qk


def _make_pv(n_heads, n_chunks):
    """The intrinsic pv(e, g, cv, h, b, i0, i1, x0, acc): acc[g + j, x0:x0 + 16 n_chunks] += sum_{i0 <= i < i1}
    e[g + j, i] * cv[h, b + i, x0:...] for j < n_heads (float32): the n_heads * n_chunks output vectors stay in
    registers over the slots, each value chunk loaded once for the heads."""
    @intrinsic
    def pv(typingctx, e, g, cv, h, b, i0, i1, x0, acc):
        if not _f32_c_arrays(e, cv, acc):
            return None
        sig = types.void(e, types.int64, cv, types.int64, types.int64, types.int64, types.int64, types.int64, acc)

        def codegen(context, builder, signature, args):
            ev, gv, cvv, hv, bv, i0v, i1v, x0v, accv = args
            ep, eshape = _row_ptr(context, builder, signature.args[0], ev, [gv])
            vp, vshape = _row_ptr(context, builder, signature.args[2], cvv, [hv, builder.add(bv, i0v)])
            ap, _ = _row_ptr(context, builder, signature.args[8], accv, [gv])
            d = vshape[2]
            zero = ir.Constant(_V16, [0.0] * 16)
            regs = [[cgutils.alloca_once_value(builder, zero) for _ in range(n_chunks)] for _ in range(n_heads)]
            with cgutils.for_range(builder, builder.sub(i1v, i0v)) as loop:
                i = loop.index
                row = builder.add(builder.mul(i, d), x0v)
                vs = [_vload(builder, vp, builder.add(row, _i64(16 * c))) for c in range(n_chunks)]
                for j in range(n_heads):
                    pe = builder.load(builder.gep(ep, [builder.add(builder.mul(_i64(j), eshape[1]),
                                                                   builder.add(i0v, i))]))
                    pb = _shuf(builder, builder.insert_element(ir.Constant(_V16, None), pe, ir.Constant(_I32, 0)),
                               ir.Constant(_V16, None), [0] * 16)
                    for c in range(n_chunks):
                        builder.store(_vfma(builder, pb, vs[c], builder.load(regs[j][c])), regs[j][c])
            for j in range(n_heads):
                for c in range(n_chunks):
                    off = builder.add(builder.add(builder.mul(_i64(j), d), x0v), _i64(16 * c))
                    _vstore(builder, builder.fadd(_vload(builder, ap, off), builder.load(regs[j][c])), ap, off)
            return context.get_dummy_value()

        return sig, codegen
    return pv


@intrinsic
def _row_max(typingctx, a, g, n):
    """The largest of a[g, :n] (float32, n >= 1), 16 lanes at a time (numba's own max loop does not vectorise)."""
    if not _f32_c_arrays(a):
        return None
    sig = types.float32(a, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        av, gv, nv = args
        ap, _ = _row_ptr(context, builder, signature.args[0], av, [gv])
        vmax = _llvm_fn(builder, "llvm.maxnum.v16f32", _V16, 2)
        smax = _llvm_fn(builder, "llvm.maxnum.f32", _F32, 2)
        acc = cgutils.alloca_once_value(builder, ir.Constant(_V16, [float("-inf")] * 16))
        n16 = builder.udiv(nv, _i64(16))
        with cgutils.for_range(builder, n16) as loop:
            v = _vload(builder, ap, builder.mul(loop.index, _i64(16)))
            builder.store(builder.call(vmax, [builder.load(acc), v]), acc)
        m = cgutils.alloca_once_value(builder, _hmax(builder, builder.load(acc)))
        base = builder.mul(n16, _i64(16))
        with cgutils.for_range(builder, builder.sub(nv, base)) as loop:
            x = builder.load(builder.gep(ap, [builder.add(base, loop.index)]))
            builder.store(builder.call(smax, [builder.load(m), x]), m)
        return builder.load(m)

    return sig, codegen


_qk3, _qk2, _qk1 = _make_qk(3, 8), _make_qk(2, 8), _make_qk(1, 16)
_pv3x4, _pv2x4, _pv1x4 = _make_pv(3, 4), _make_pv(2, 4), _make_pv(1, 4)
_pv3x1, _pv2x1, _pv1x1 = _make_pv(3, 1), _make_pv(2, 1), _make_pv(1, 1)


# ---------------------------------------------------------------- the attention pass

@njit(cache=True, nogil=True, fastmath=_VECTOR_MATH)
def _dots3(q, t, hq, ck, h, b, i0, n, dots, g):
    """dots[g + j, i] = q[t, hq + j] . ck[h, b + i] for j < 3 and i0 <= i < n (d % 16 != 0, or the keys after the SIMD
    blocks): three query heads and two keys per pass, all six accumulators live (SIMD over d), each key element
    loaded once for six multiply-adds."""
    d = q.shape[2]
    i = i0
    while i + 2 <= n:
        a00 = np.float32(0.0)
        a01 = np.float32(0.0)
        a10 = np.float32(0.0)
        a11 = np.float32(0.0)
        a20 = np.float32(0.0)
        a21 = np.float32(0.0)
        for x in range(d):
            k0 = ck[h, b + i, x]
            k1 = ck[h, b + i + 1, x]
            q0 = q[t, hq, x]
            q1 = q[t, hq + 1, x]
            q2 = q[t, hq + 2, x]
            a00 += q0 * k0
            a01 += q0 * k1
            a10 += q1 * k0
            a11 += q1 * k1
            a20 += q2 * k0
            a21 += q2 * k1
        dots[g, i] = a00
        dots[g, i + 1] = a01
        dots[g + 1, i] = a10
        dots[g + 1, i + 1] = a11
        dots[g + 2, i] = a20
        dots[g + 2, i + 1] = a21
        i += 2
    if i < n:
        a0 = np.float32(0.0)
        a1 = np.float32(0.0)
        a2 = np.float32(0.0)
        for x in range(d):
            k0 = ck[h, b + i, x]
            a0 += q[t, hq, x] * k0
            a1 += q[t, hq + 1, x] * k0
            a2 += q[t, hq + 2, x] * k0
        dots[g, i] = a0
        dots[g + 1, i] = a1
        dots[g + 2, i] = a2


@njit(cache=True, nogil=True, fastmath=_VECTOR_MATH)
def _dots2(q, t, hq, ck, h, b, i0, n, dots, g):
    """``_dots3`` for two query heads, three keys per pass."""
    d = q.shape[2]
    i = i0
    while i + 3 <= n:
        a00 = np.float32(0.0)
        a01 = np.float32(0.0)
        a02 = np.float32(0.0)
        a10 = np.float32(0.0)
        a11 = np.float32(0.0)
        a12 = np.float32(0.0)
        for x in range(d):
            k0 = ck[h, b + i, x]
            k1 = ck[h, b + i + 1, x]
            k2 = ck[h, b + i + 2, x]
            q0 = q[t, hq, x]
            q1 = q[t, hq + 1, x]
            a00 += q0 * k0
            a01 += q0 * k1
            a02 += q0 * k2
            a10 += q1 * k0
            a11 += q1 * k1
            a12 += q1 * k2
        dots[g, i] = a00
        dots[g, i + 1] = a01
        dots[g, i + 2] = a02
        dots[g + 1, i] = a10
        dots[g + 1, i + 1] = a11
        dots[g + 1, i + 2] = a12
        i += 3
    while i < n:
        a0 = np.float32(0.0)
        a1 = np.float32(0.0)
        for x in range(d):
            k0 = ck[h, b + i, x]
            a0 += q[t, hq, x] * k0
            a1 += q[t, hq + 1, x] * k0
        dots[g, i] = a0
        dots[g + 1, i] = a1
        i += 1


@njit(cache=True, nogil=True, fastmath=_VECTOR_MATH)
def _dots1(q, t, hq, ck, h, b, i0, n, dots, g):
    """``_dots3`` for one query head, four keys per pass."""
    d = q.shape[2]
    i = i0
    while i + 4 <= n:
        a0 = np.float32(0.0)
        a1 = np.float32(0.0)
        a2 = np.float32(0.0)
        a3 = np.float32(0.0)
        for x in range(d):
            qx = q[t, hq, x]
            a0 += qx * ck[h, b + i, x]
            a1 += qx * ck[h, b + i + 1, x]
            a2 += qx * ck[h, b + i + 2, x]
            a3 += qx * ck[h, b + i + 3, x]
        dots[g, i] = a0
        dots[g, i + 1] = a1
        dots[g, i + 2] = a2
        dots[g, i + 3] = a3
        i += 4
    while i < n:
        acc = np.float32(0.0)
        for x in range(d):
            acc += q[t, hq, x] * ck[h, b + i, x]
        dots[g, i] = acc
        i += 1


@njit(cache=True, nogil=True)
def _group_chunk(left):
    """How many of the ``left`` query heads of a group the next pass of ``qk_dots``/``weighted_sums`` takes: threes,
    then twos (4 -> 2 + 2, 5 -> 3 + 2), one only when the group has one head."""
    if left == 2 or left == 4:
        return 2
    return 3 if left >= 3 else 1


@njit(cache=True, nogil=True)
def qk_dots(q, t, h, g_n, ck, b, n, dots, mx):
    """dots[g, i] = q[t, h*G + g] . ck[h, b + i] in float32 for the G query heads of KV head h (its n slots from
    row b of the cache), and each head's largest dot in mx[g] (n >= 1): the heads in passes of up to three, each
    key loaded once per pass for all of them; the SIMD kernels take blocks of eight keys (sixteen for a lone head)
    when d % 16 == 0, the numba loops the rest."""
    simd = q.shape[2] % 16 == 0
    g = 0
    while g < g_n:
        c = _group_chunk(g_n - g)
        hq = h * g_n + g
        i = 0
        if c == 3:
            if simd:
                while i + 8 <= n:
                    _qk3(q, t, hq, ck, h, b, i, dots, g)
                    i += 8
            _dots3(q, t, hq, ck, h, b, i, n, dots, g)
        elif c == 2:
            if simd:
                while i + 8 <= n:
                    _qk2(q, t, hq, ck, h, b, i, dots, g)
                    i += 8
            _dots2(q, t, hq, ck, h, b, i, n, dots, g)
        else:
            if simd:
                while i + 16 <= n:
                    _qk1(q, t, hq, ck, h, b, i, dots, g)
                    i += 16
            _dots1(q, t, hq, ck, h, b, i, n, dots, g)
        g += c
    for g in range(g_n):
        mx[g] = _row_max(dots, g, n)


@njit(cache=True, nogil=True, fastmath=_VECTOR_MATH)
def qk_dot32(q, t, hq, k, src, h):
    """q[t, hq] . k[src, h] in float32 (SIMD over d): a merged slot's original logit."""
    acc = np.float32(0.0)
    for x in range(q.shape[2]):
        acc += q[t, hq, x] * k[src, h, x]
    return acc


#: slots per float32 block of ``weighted_sums``, each block's sums added into the float64 outputs (a float32 sum
#: of 256 terms p_i v_i, p_i <= 1, is within 256 ulp of |v|max at worst, typically 16)
_PV_BLOCK = 256


@njit(cache=True, nogil=True, fastmath=_VECTOR_MATH)
def _pv3(e, g, cv, h, b, i0, i1, acc):
    """acc[g + j] += sum_{i0 <= i < i1} e[g + j, i] * cv[h, b + i] for j < 3 in float32 (d % 16 != 0): four value rows
    per pass, each loaded once for the three heads (SIMD over d)."""
    d = cv.shape[2]
    i = i0
    while i + 4 <= i1:
        a0 = e[g, i]
        a1 = e[g, i + 1]
        a2 = e[g, i + 2]
        a3 = e[g, i + 3]
        b0 = e[g + 1, i]
        b1 = e[g + 1, i + 1]
        b2 = e[g + 1, i + 2]
        b3 = e[g + 1, i + 3]
        c0 = e[g + 2, i]
        c1 = e[g + 2, i + 1]
        c2 = e[g + 2, i + 2]
        c3 = e[g + 2, i + 3]
        for x in range(d):
            v0 = cv[h, b + i, x]
            v1 = cv[h, b + i + 1, x]
            v2 = cv[h, b + i + 2, x]
            v3 = cv[h, b + i + 3, x]
            acc[g, x] += (a0 * v0 + a1 * v1) + (a2 * v2 + a3 * v3)
            acc[g + 1, x] += (b0 * v0 + b1 * v1) + (b2 * v2 + b3 * v3)
            acc[g + 2, x] += (c0 * v0 + c1 * v1) + (c2 * v2 + c3 * v3)
        i += 4
    while i < i1:
        a0 = e[g, i]
        b0 = e[g + 1, i]
        c0 = e[g + 2, i]
        for x in range(d):
            v0 = cv[h, b + i, x]
            acc[g, x] += a0 * v0
            acc[g + 1, x] += b0 * v0
            acc[g + 2, x] += c0 * v0
        i += 1


@njit(cache=True, nogil=True, fastmath=_VECTOR_MATH)
def _pv2(e, g, cv, h, b, i0, i1, acc):
    """``_pv3`` for two heads."""
    d = cv.shape[2]
    i = i0
    while i + 4 <= i1:
        a0 = e[g, i]
        a1 = e[g, i + 1]
        a2 = e[g, i + 2]
        a3 = e[g, i + 3]
        b0 = e[g + 1, i]
        b1 = e[g + 1, i + 1]
        b2 = e[g + 1, i + 2]
        b3 = e[g + 1, i + 3]
        for x in range(d):
            v0 = cv[h, b + i, x]
            v1 = cv[h, b + i + 1, x]
            v2 = cv[h, b + i + 2, x]
            v3 = cv[h, b + i + 3, x]
            acc[g, x] += (a0 * v0 + a1 * v1) + (a2 * v2 + a3 * v3)
            acc[g + 1, x] += (b0 * v0 + b1 * v1) + (b2 * v2 + b3 * v3)
        i += 4
    while i < i1:
        a0 = e[g, i]
        b0 = e[g + 1, i]
        for x in range(d):
            v0 = cv[h, b + i, x]
            acc[g, x] += a0 * v0
            acc[g + 1, x] += b0 * v0
        i += 1


@njit(cache=True, nogil=True, fastmath=_VECTOR_MATH)
def _pv1(e, g, cv, h, b, i0, i1, acc):
    """``_pv3`` for one head."""
    d = cv.shape[2]
    i = i0
    while i + 4 <= i1:
        a0 = e[g, i]
        a1 = e[g, i + 1]
        a2 = e[g, i + 2]
        a3 = e[g, i + 3]
        for x in range(d):
            acc[g, x] += ((a0 * cv[h, b + i, x] + a1 * cv[h, b + i + 1, x])
                          + (a2 * cv[h, b + i + 2, x] + a3 * cv[h, b + i + 3, x]))
        i += 4
    while i < i1:
        a0 = e[g, i]
        for x in range(d):
            acc[g, x] += a0 * cv[h, b + i, x]
        i += 1


@njit(cache=True, nogil=True)
def _pv_heads(e, g, c, cv, h, b, i0, i1, acc):
    """acc[g:g + c] += the slots [i0, i1)'s share (value rows from b + i0) of the c (1 to 3) heads' weighted sums of
    value rows: the SIMD kernels over slices of 64 then 16 channels when d % 16 == 0, else the numba loops."""
    d = cv.shape[2]
    if d % 16 != 0:
        if c == 3:
            _pv3(e, g, cv, h, b, i0, i1, acc)
        elif c == 2:
            _pv2(e, g, cv, h, b, i0, i1, acc)
        else:
            _pv1(e, g, cv, h, b, i0, i1, acc)
        return
    x0 = 0
    while x0 + 64 <= d:
        if c == 3:
            _pv3x4(e, g, cv, h, b, i0, i1, x0, acc)
        elif c == 2:
            _pv2x4(e, g, cv, h, b, i0, i1, x0, acc)
        else:
            _pv1x4(e, g, cv, h, b, i0, i1, x0, acc)
        x0 += 64
    while x0 < d:
        if c == 3:
            _pv3x1(e, g, cv, h, b, i0, i1, x0, acc)
        elif c == 2:
            _pv2x1(e, g, cv, h, b, i0, i1, x0, acc)
        else:
            _pv1x1(e, g, cv, h, b, i0, i1, x0, acc)
        x0 += 16


@njit(cache=True, nogil=True, fastmath=_VECTOR_MATH)
def _flush(acc, g_n, oacc):
    """oacc[:G] += acc[:G] (float32 block sums into the float64 outputs); acc is zeroed for the next block."""
    for g in range(g_n):
        for x in range(acc.shape[1]):
            oacc[g, x] += np.float64(acc[g, x])
            acc[g, x] = np.float32(0.0)


@njit(cache=True, nogil=True, fastmath=_VECTOR_MATH)
def weighted_sums(e, inv, h, g_n, cv, b, n, oacc, acc):
    """oacc[g] = inv[g] * sum_i e[g, i] * cv[h, b + i] for the G query heads of KV head h, its n slots from row b
    (the cache's attention outputs, e the unnormalised float32 softmax numerators, inv their float64 normalisers):
    float32 sums over blocks of ``_PV_BLOCK`` slots (the heads in passes of up to three, ``_pv_heads``), each block
    added into float64."""
    d = cv.shape[2]
    for g in range(g_n):
        for x in range(d):
            oacc[g, x] = 0.0
            acc[g, x] = np.float32(0.0)     # _flush zeroes it after every block
    i0 = 0
    while i0 < n:
        i1 = min(n, i0 + _PV_BLOCK)
        g = 0
        while g < g_n:
            c = _group_chunk(g_n - g)
            _pv_heads(e, g, c, cv, h, b, i0, i1, acc)
            g += c
        _flush(acc, g_n, oacc)
        i0 = i1
    for g in range(g_n):
        for x in range(d):
            oacc[g, x] *= inv[g]

