"""Errors raised by the varlen attention/compaction kernels and their cache wrapper."""


class KernelInputError(ValueError):
    """A tensor given to a kernel launcher has the wrong shape, dtype, device or contents."""


class CacheCapacityError(KernelInputError):
    """An append or compaction would put more slots in a head's region than its capacity."""
