"""Ada-KV (Feng et al., 2024)'s paper policies: SnapKV, PyramidKV and H2O with head-wise budget allocation.

Each is a name of the ``ada`` combinator over the policy (policies/core/stage_ada.py holds the allocation, its
safeguard and kernels): ``ada_snapkv`` is ``ada(snapkv)``, ``ada_pyramidkv`` is ``ada(pyramidkv)``, ``ada_h2o`` is
``ada(h2o)``, the same class and results under a plain label (``kvsim policies`` lists the alias instead of the
combinator spelling). The paper's evaluation settings are those of the wrapped policies (SnapKV's observation
window 32 with max pooling 7, PyramidKV's beta 20) and of ``ada``'s ``floor_alpha``.
"""
from policies.core.combinators import alias
from policies.h2o import H2O
from policies.snapkv import PyramidKV, SnapKV

AdaSnapkv = alias("ada_snapkv", "ada", SnapKV, "SnapKV with Ada-KV head-wise budget allocation")
AdaPyramidkv = alias("ada_pyramidkv", "ada", PyramidKV, "PyramidKV with Ada-KV head-wise budget allocation")
AdaH2o = alias("ada_h2o", "ada", H2O, "H2O accumulated scores with Ada-KV head-wise budget allocation")
