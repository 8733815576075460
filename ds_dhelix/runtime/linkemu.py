"""Emulate a slow network link for multi-process gloo runs on one machine.

A command is re-run inside a private network namespace (``unshare -n``) whose only interface, the
loopback, is brought up and shaped by a token-bucket filter::

    unshare -n sh -c 'ip link set lo up && tc qdisc add dev lo root tbf rate 2gbit burst 512kb
                      latency 100ms && export GLOO_SOCKET_IFNAME=lo MASTER_ADDR=127.0.0.1 &&
                      exec "$@"' sh  python train.py ...

Every process the command starts (torch.multiprocessing ranks, the deepspeed launcher's children)
inherits the namespace, so all rank-to-rank traffic is real TCP through gloo at the shaped rate.
The namespace has no route to the outside world, and its ports never collide with the host's.

Needs root (or unprivileged user namespaces), ``unshare``, ``ip`` and ``tc`` with the tbf qdisc.
Where that is missing, the command runs unshaped and a warning says so.
"""

from __future__ import annotations

import functools
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

LINK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}


class LinkCommand(NamedTuple):
    """A command line to run, and a warning for the caller to print (None: all went as asked)."""

    argv: list[str]
    warning: str | None


def _unshare_prefix() -> list[str]:
    # As root a plain network namespace; otherwise map ourselves to root in a user namespace.
    return ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-r", "-n"]


# Token-bucket burst just above the loopback MTU (64 KiB): an idle link banks almost no credit, so a
# message sent after a long compute phase does not beat the nominal rate (a 512 KB burst did).
DEFAULT_BURST_KB = 96


def _shaping_script(gbps: float, burst_kb: int, latency_ms: float) -> str:
    exports = " ".join(f"{k}={v}" for k, v in LINK_ENV.items())
    return (
        f"ip link set lo up && "
        f"tc qdisc add dev lo root tbf rate {gbps:g}gbit burst {burst_kb}kb "
        f"latency {latency_ms:g}ms && "
        f'export {exports} && exec "$@"'
    )


@functools.cache
def link_emulation_available() -> tuple[bool, str]:
    """Whether shaped namespaces work here: ``(True, how)`` or ``(False, why not)``.

    Checks the tools, then really creates a shaped namespace once (the result is cached).
    """
    missing = [tool for tool in ("unshare", "ip", "tc") if shutil.which(tool) is None]
    if missing:
        return False, f"missing tools: {', '.join(missing)} (install util-linux and iproute2)"
    argv = [*_unshare_prefix(), "sh", "-c", _shaping_script(1, 512, 100), "sh", "true"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return False, f"cannot create a network namespace: {err}"
    if proc.returncode != 0:
        who = "root" if os.geteuid() == 0 else "non-root (user namespaces)"
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        return False, (
            f"cannot create a shaped network namespace as {who}: "
            f"{detail[-1] if detail else f'exit code {proc.returncode}'}"
        )
    return True, f"{' '.join(_unshare_prefix())} + tc tbf on lo"


def wrap_command(
    argv: Sequence[str], gbps: float | None, burst_kb: int = DEFAULT_BURST_KB, latency_ms: float = 100
) -> LinkCommand:
    """Wrap ``argv`` so it runs behind a loopback shaped to ``gbps`` Gbit/s.

    ``gbps=None`` runs unshaped in the host namespace (only the gloo env is set). When emulation is
    unavailable the command comes back unchanged with a warning saying why.
    """
    argv = [str(a) for a in argv]
    if not argv:
        raise ValueError("wrap_command: empty command; pass e.g. [sys.executable, 'bench.py']")
    if gbps is None:
        env = [f"{k}={v}" for k, v in LINK_ENV.items()]
        return LinkCommand(["env", *env, *argv], None)
    if not gbps > 0:
        raise ValueError(f"wrap_command: gbps={gbps!r} must be > 0 (or None for an unshaped link)")
    if burst_kb <= 0 or latency_ms <= 0:
        raise ValueError(
            f"wrap_command: burst_kb={burst_kb!r} and latency_ms={latency_ms!r} must be > 0 (defaults: 512 and 100)"
        )
    ok, reason = link_emulation_available()
    if not ok:
        return LinkCommand(argv, f"link emulation unavailable ({reason}); running UNSHAPED instead of {gbps:g} Gbit/s")
    script = _shaping_script(gbps, burst_kb, latency_ms)
    return LinkCommand([*_unshare_prefix(), "sh", "-c", script, "sh", *argv], None)


def run_in_link(
    target: Sequence[str] | Callable[..., Any],
    gbps: float | None,
    *,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float | None = None,
    burst_kb: int = DEFAULT_BURST_KB,
    latency_ms: float = 100,
    **run_kwargs,
) -> Any:
    """Run a command line or a function in a subprocess behind a ``gbps`` link.

    A command (list of str) returns its ``subprocess.CompletedProcess`` (``run_kwargs`` go to
    ``subprocess.run``). A function must be importable by name (module level); it is called with
    ``args``/``kwargs`` in a fresh interpreter and its (picklable) return value comes back; a
    failure raises ``RuntimeError`` with the child's stderr. A missing emulation is warned about on
    stderr and the run goes ahead unshaped.
    """
    if callable(target):
        return _run_function(target, gbps, args, kwargs or {}, timeout, burst_kb, latency_ms)
    cmd = wrap_command(target, gbps, burst_kb, latency_ms)
    if cmd.warning:
        print(f"[dhelix linkemu] {cmd.warning}", file=sys.stderr)
    return subprocess.run(cmd.argv, timeout=timeout, **run_kwargs)


def _run_function(fn, gbps, args, kwargs, timeout, burst_kb, latency_ms):
    with tempfile.TemporaryDirectory(prefix="dhelix_link_") as tmp:
        payload, result = os.path.join(tmp, "call.pkl"), os.path.join(tmp, "result.pkl")
        with open(payload, "wb") as f:
            pickle.dump((fn, args, kwargs), f)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        argv = [sys.executable, "-m", "ds_dhelix.runtime.linkemu", payload, result]
        proc = run_in_link(
            argv,
            gbps,
            timeout=timeout,
            burst_kb=burst_kb,
            latency_ms=latency_ms,
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"run_in_link({getattr(fn, '__qualname__', fn)!r}, gbps={gbps}) "
                f"failed with exit code {proc.returncode}:\n{proc.stderr}"
            )
        with open(result, "rb") as f:
            return pickle.load(f)


def _call_main(payload: str, result: str) -> None:
    """Child side of ``run_in_link`` for functions: load, call, store the return value."""
    with open(payload, "rb") as f:
        fn, args, kwargs = pickle.load(f)
    value = fn(*args, **kwargs)
    with open(result, "wb") as f:
        pickle.dump(value, f)


if __name__ == "__main__":
    _call_main(*sys.argv[1:3])
