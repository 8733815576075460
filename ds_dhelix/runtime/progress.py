"""Progress bars (tqdm) that leave nothing behind in a rank process.

tqdm guards its bars with a multiprocessing lock by default: a named semaphore, which a rank
started by ``torch.multiprocessing.spawn`` never releases, so every run ended with
``resource_tracker: There appear to be N leaked semaphore objects``. Our bars are written by one
process each; a thread lock is all they need.
"""

from __future__ import annotations

import threading


def thread_locked_bars() -> None:
    """Every tqdm bar of this process (its subclasses: ``tqdm.auto``, transformers') under one
    thread lock from now on (see the module docstring)."""
    from tqdm import tqdm

    if not getattr(tqdm, "_dhelix_lock", False):
        tqdm.set_lock(threading.RLock())
        tqdm._dhelix_lock = True


def progress(iterable=None, **kwargs):
    """``tqdm(iterable, **kwargs)`` under a thread lock (see the module docstring)."""
    from tqdm import tqdm

    thread_locked_bars()
    return tqdm(iterable, **kwargs)
