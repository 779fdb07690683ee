"""Ahead-of-time compile every kernel variant for a CUDA arch without a GPU (catches GPU-only compile errors).

The interpreter (TRITON_INTERPRET=1) runs the kernels with numpy semantics and cannot see errors that only the
compiler raises (tl.dot shape/dtype rules, loop-carried types, shared-memory limits). This module lowers the
kernels through the real NVIDIA pipeline to a cubin with the ptxas bundled in the triton wheel.
Usage: `python -m gpu_validate.kvcache.kernels.compile_check [--arch 90] [--quick]` (must run without TRITON_INTERPRET).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator

ATTN_SPLIT_SIG = dict(Q="*{dt}", K="*{dt}", V="*{dt}", START="*i32", LENGTH="*i32", LOGITS="*fp32", M_PART="*fp32",
                      L_PART="*fp32", O_PART="*fp32", qk_scale="fp32", stride_qb="i32", stride_qh="i32",
                      stride_kn="i32", stride_vn="i32", N_KV_HEADS="i32", CHUNK="i32", N_SPLITS="i32")
ATTN_REDUCE_SIG = dict(LOGITS="*fp32", ACC="*fp32", EMA="*fp32", M_PART="*fp32", L_PART="*fp32", O_PART="*fp32",
                       O="*{dt}", LSE="*fp32", START="*i32", LENGTH="*i32", ema_gamma="fp32", stride_ob="i32",
                       stride_oh="i32", N_KV_HEADS="i32", CHUNK="i32", N_SPLITS="i32")
MERGE_SIG = dict(K="*{dt}", V="*{dt}", KEEP_ACTIVE="*u8", MERGE_W="*fp32", ORDER="*i64", SEG_LO="*i64",
                 SEG_HI="*i64", TOTAL="i32", stride_kn="i32", stride_vn="i32")
COMPACT_SIG = dict(K="*{dt}", V="*{dt}", POS="*i64", ACC="*fp32", EMA="*fp32", KEEP="*u8", START="*i32",
                   LENGTH="*i32", CAPACITY="*i32", STATUS="*i32", K_NEW="*{dt}", V_NEW="*{dt}", POS_NEW="*i64",
                   stride_kn="i32", stride_vn="i32", stride_knh="i32", stride_knn="i32", stride_vnh="i32",
                   stride_vnn="i32", N_NEW="i32", acc_init="fp32", ema_init="fp32")
DOT_MODE = {"fp16": 0, "bf16": 1, "fp32": 2}


def variants(quick: bool) -> Iterator[tuple[str, dict, dict, dict]]:
    """(kernel name, signature, constexprs, launch options) for the configurations the launchers use."""
    dtypes = ["fp16"] if quick else ["fp16", "bf16", "fp32"]
    for dt in dtypes:
        for g, d in ([(4, 128)] if quick else [(1, 64), (4, 128), (8, 128)]):
            for bn, nw in ([(64, 4)] if quick else [(32, 4), (64, 4), (128, 8)]):
                yield ("_attn_split_kernel", {k: v.format(dt=dt) for k, v in ATTN_SPLIT_SIG.items()},
                       dict(G=g, HEAD_DIM=d, BLOCK_G=max(16, g), BLOCK_D=d, BLOCK_N=bn, WRITE_LOGITS=True,
                            DOT_MODE=DOT_MODE[dt]), dict(num_warps=nw, num_stages=2))
            yield ("_attn_reduce_kernel", {k: v.format(dt=dt) for k, v in ATTN_REDUCE_SIG.items()},
                   dict(G=g, HEAD_DIM=d, BLOCK_G=max(16, g), BLOCK_D=d, BLOCK_S=32, BLOCK_N=64, SCORES=True,
                        WRITE_PROBS=True, UPDATE_ACC=True, UPDATE_EMA=True), dict(num_warps=4))
        yield ("_merge_kernel", {k: v.format(dt=dt) for k, v in MERGE_SIG.items()},
               dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_T=32), dict(num_warps=4))
        for keep_all in (False, True):
            yield ("_compact_kernel", {k: v.format(dt=dt) for k, v in COMPACT_SIG.items()},
                   dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_N=128, KEEP_ALL=keep_all, HAS_POS=True, HAS_ACC=True,
                        HAS_EMA=True, HAS_POS_NEW=True), dict(num_warps=4, num_stages=1))


def compile_all(arch: int = 90, quick: bool = False) -> list[str]:
    """Compile every variant for sm_<arch>; returns one line per variant; raises on the first failure."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_check must run with TRITON_INTERPRET unset (kernels are interpreted otherwise)")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gpu_validate.kvcache.kernels import attention, compaction

    kernels = {f: getattr(m, f) for m in (attention, compaction) for f in dir(m) if f.startswith("_") and
               f.endswith("_kernel")}
    done = []
    for name, sig, consts, opts in variants(quick):
        fn = kernels[name]
        full = {a: ("constexpr" if a in consts else sig[a]) for a in fn.arg_names}
        # as the JIT does at launch: 16-aligned pointers (torch allocations) and strides divisible by 16
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
                 if a not in consts and (sig[a].startswith("*") or a.startswith("stride"))}
        compiled = triton.compile(ASTSource(fn, full, consts, attrs), target=GPUTarget("cuda", arch, 32),
                                  options=opts)
        ptx = compiled.asm["ptx"]
        vectorized = "cp.async" in ptx or "ld.global.v4" in ptx or "ld.global.nc.v4" in ptx
        done.append(f"{name} {consts} {opts}: ok, shared memory {compiled.metadata.shared} B, "
                    f"vectorized loads {'yes' if vectorized else 'no'}")
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability as an int (80, 90, ...)")
    ap.add_argument("--quick", action="store_true", help="one variant per kernel")
    args = ap.parse_args(argv)
    for line in compile_all(args.arch, args.quick):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
