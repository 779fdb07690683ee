"""`move_rows`: a block move of array rows at memmove speed inside numba code (the replay engine's compaction, the
closed loop's host-side compaction)."""
from __future__ import annotations

from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def move_rows(typingctx, arr, i, j, dst):
    """Move rows [i, j) of the C-contiguous array ``arr`` to rows [dst, dst + j - i): one ``llvm.memmove`` (the
    regions may overlap), so the copy runs at the C library's memmove speed."""
    if not (isinstance(arr, types.Array) and arr.layout == "C"):
        return None

    def codegen(context, builder, signature, args):
        a, lo, hi, to = args
        ary = context.make_array(signature.args[0])(context, builder, a)
        shapes = cgutils.unpack_tuple(builder, ary.shape, arr.ndim)
        row = context.get_constant(types.intp, 1)
        for extent in shapes[1:]:
            row = builder.mul(row, extent)
        itemsize = context.get_constant(types.intp, context.get_abi_sizeof(context.get_data_type(arr.dtype)))
        base = builder.bitcast(ary.data, cgutils.voidptr_t)
        src = builder.gep(base, [builder.mul(builder.mul(lo, row), itemsize)])
        dest = builder.gep(base, [builder.mul(builder.mul(to, row), itemsize)])
        cgutils.raw_memmove(builder, dest, src, builder.mul(builder.sub(hi, lo), row), itemsize)
        return context.get_dummy_value()

    return types.void(arr, types.intp, types.intp, types.intp), codegen
