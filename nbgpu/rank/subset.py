"""A warm cell that runs on some ranks only (``--ranks``): a collective that needs a rank
outside the cell would wait forever, so it is refused or reported instead.

While such a cell runs, torch.distributed's Python collectives (and a DDP model's forward,
whose backward all-reduces from C++) raise :class:`IdleRanksError` (one line: which call,
which ranks it needs) when their group holds a rank that does not run the cell; and a
watchdog thread reports a main thread that sits inside torch's
distributed code longer than the kernel's wait (a collective called from C++, such as
DDP's, or through a name no wrapper replaced): the kernel then says where and returns.
Standard library only: torch is wrapped only when the user's code imported it already.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["IdleRanksError", "on_ranks"]

#: Calls that every rank of their group must make (the group: their ``group`` argument).
GROUP_CALLS = (
    "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather",
    "all_gather_into_tensor", "all_gather_coalesced", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
)  # fmt: skip
#: Calls with one peer (a global rank: ``dst`` or ``src``).
PEER_CALLS = ("send", "recv", "isend", "irecv", "send_object_list", "recv_object_list")
#: Calls that every rank of the job makes (new groups are agreed on by all).
WORLD_CALLS = ("new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group")
# Where a rank waits for others when the wait is not one of the calls above.
_TORCH_WAITS = (f"torch{os.sep}distributed{os.sep}", f"torch{os.sep}nn{os.sep}parallel{os.sep}")
_MODULES = ("torch.distributed", "torch.distributed.distributed_c10d")
_OURS = str(Path(__file__).parents[1])  # nbgpu's frames are not the user's line


class IdleRanksError(RuntimeError):
    """A collective in a ``--ranks`` cell needs ranks that do not run it."""


class _Guard:
    """The wrapped collectives and the watchdog of one ``--ranks`` cell; ``close()`` undoes."""

    def __init__(
        self,
        chosen: Sequence[int],
        namespace: dict[str, Any],
        report: Callable[[str], None],
        wait_s: float,
    ) -> None:
        self.chosen = sorted(chosen)
        self.wait_s = wait_s
        self.swapped: list[tuple[Any, str, Any]] = []  # (owner, name, original)
        self.checked_calls = 0  # calls in flight whose group runs the cell: their wait is fair
        self.done = threading.Event()
        self.dist = sys.modules.get("torch.distributed")
        if self.dist is not None and self.dist.is_available() and self.dist.is_initialized():
            self._wrap(namespace)
        main = threading.main_thread().ident
        watch = threading.Thread(target=self._watch, args=(main, report), daemon=True)
        watch.start()

    def _wrap(self, namespace: dict[str, Any]) -> None:
        originals: dict[int, Any] = {}
        for module in filter(None, map(sys.modules.get, _MODULES)):
            for name in (*GROUP_CALLS, *PEER_CALLS, *WORLD_CALLS):
                original = getattr(module, name, None)
                if callable(original):
                    originals[id(original)] = original
                    self._swap(module, name, self._checked(name, original))
        # DDP's gradient all-reduce runs in autograd's C++ engine, under no frame the watchdog
        # reads: refuse its forward instead, whose backward would need the whole group.
        parallel = sys.modules.get("torch.nn.parallel")
        ddp = getattr(parallel, "DistributedDataParallel", None)
        if ddp is not None:
            self._swap(ddp, "forward", self._checked_ddp(ddp.forward))
        # Names the user bound earlier (``from torch.distributed import all_reduce``).
        for name, value in list(namespace.items()):
            if id(value) in originals and value is originals[id(value)]:
                self._swap(namespace, name, self._checked(value.__name__, value), item=True)

    def _swap(self, owner: Any, name: str, new: Any, *, item: bool = False) -> None:
        self.swapped.append((owner, name, owner[name] if item else getattr(owner, name)))
        if item:
            owner[name] = new
        else:
            setattr(owner, name, new)

    def _checked(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def checked(*args: Any, **kwargs: Any) -> Any:
            try:
                given = signature.bind_partial(*args, **kwargs).arguments
            except TypeError:
                given = {}  # torch's own error says what is wrong with the call
            self._check(name, given)
            self.checked_calls += 1
            try:
                return original(*args, **kwargs)
            finally:
                self.checked_calls -= 1

        return functools.wraps(original)(checked)

    def _checked_ddp(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        def checked(model: Any, *args: Any, **kwargs: Any) -> Any:
            self._check("DistributedDataParallel's forward", {"group": model.process_group})
            return forward(model, *args, **kwargs)

        return functools.wraps(forward)(checked)

    def _check(self, name: str, given: dict[str, Any]) -> None:
        dist = self.dist
        assert dist is not None  # noqa: S101  (wrapped only when torch.distributed is loaded)
        group = given.get("group")
        if name in PEER_CALLS:
            peer = given.get("dst", given.get("src"))
            in_group = given.get("group_dst", given.get("group_src"))
            if peer is None and in_group is not None and group is not None:
                peer = dist.get_global_rank(group, in_group)
            needed = [] if peer is None else [int(peer)]
            whose = "as its peer"
        elif name in WORLD_CALLS:
            local = name == "new_group" and given.get("use_local_synchronization")
            needed = list(given.get("ranks") or []) if local else list(range(dist.get_world_size()))
            whose = "of the job (every rank makes new groups together)"
        else:
            needed = dist.get_process_group_ranks(group or dist.group.WORLD)
            if dist.get_rank() not in needed:
                return  # not a member: torch returns at once
            whose = "of the default group" if group is None else "of its group"
        missing = sorted(set(needed) - set(self.chosen))
        if missing:
            ran = ",".join(map(str, self.chosen))
            raise IdleRanksError(
                f"{name} needs rank{'s' * (len(missing) > 1)} {','.join(map(str, missing))} "
                f"{whose}, which do not run this cell (--ranks {ran}): run it on every rank, "
                "or leave it out"
            )

    def _watch(self, main: int | None, report: Callable[[str], None]) -> None:
        """Report once when the main thread waits inside torch's distributed code too long."""
        since: float | None = None
        while not self.done.wait(0.2):
            frame = sys._current_frames().get(main or 0)
            where = None if self.checked_calls else _torch_wait(frame)
            if where is None:
                since = None
            elif since is None:
                since = time.monotonic()
            elif time.monotonic() - since > self.wait_s:
                report(f"in {where} for {self.wait_s:.0f} s")
                return

    def close(self) -> None:
        self.done.set()
        for owner, name, original in reversed(self.swapped):
            if isinstance(owner, dict):
                owner[name] = original
            else:
                setattr(owner, name, original)


def _torch_wait(frame: Any) -> str | None:
    """``barrier at cell3.py:4``: when the thread's innermost Python frame is torch's
    distributed code (it waits in C++ below it), that call and the line that made it."""
    if frame is None or not any(part in frame.f_code.co_filename for part in _TORCH_WAITS):
        return None
    call = frame.f_code.co_qualname
    while frame is not None:
        filename = frame.f_code.co_filename
        if f"{os.sep}torch{os.sep}" not in filename and not filename.startswith(_OURS):
            return f"{call} at {Path(filename).name}:{frame.f_lineno}"
        frame = frame.f_back
    return str(call)


def on_ranks(
    message: dict[str, Any], namespace: dict[str, Any], report: Callable[[dict[str, Any]], None]
) -> _Guard | None:
    """The guard of a ``--ranks`` cell (None when every rank runs it); ``close()`` it after."""
    chosen = message.get("ranks")
    if chosen is None:
        return None
    cell = message.get("cell")
    return _Guard(
        chosen,
        namespace,
        lambda where: report({"op": "waiting", "cell": cell, "where": where}),
        float(message.get("collective_wait_s") or 5.0),
    )
