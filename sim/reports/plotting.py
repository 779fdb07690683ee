"""Plot helpers shared by the simulator (sim.reports.report) and the model-side tools (gpu_validate): one public home,
so neither package reaches into the other's private functions."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def agg_pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend (headless machines, CI). Imported here, when a plot is
    drawn: matplotlib stays out of every command that draws nothing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def current_umask() -> int:
    """This process's umask (read by setting and restoring it)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_figure(fig, path: str | Path, dpi: int = 130) -> Path:
    """Write a matplotlib figure atomically (temp file + rename; format from the suffix) and free it."""
    import matplotlib.pyplot as plt   # deferred as in agg_pyplot (pyplot takes 0.7 s to import)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".fig-", suffix=path.suffix or ".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=dpi)
        os.chmod(tmp, 0o666 & ~current_umask())     # mkstemp creates 0600; a plot is as readable as any file
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        Path(tmp).unlink(missing_ok=True)
    return path
