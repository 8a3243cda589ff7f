"""Diagnose: from a failed run's logs to the cause, the first failing rank, and the fix.

    import nbgpu
    nbgpu.diagnose("runs/2024-05-01-sweep1")        # a run directory
    nbgpu.diagnose("train.log", inventory=nbgpu.status())
    nbgpu.diagnose(log_text).root.fixes

The package is callable: ``nbgpu.diagnose(...)`` calls :func:`diagnose`, while
``nbgpu.diagnose.Diagnosis``, ``.CATALOG`` etc. stay reachable as attributes.

Layout (one idea per module): ``catalog`` (causes, patterns, fixes: data) · ``lines``
(prefixes, ranks, timestamps) · ``window`` (streaming bytes to the lines worth reading) ·
``scan`` (hits, exits, tracebacks of one source) · ``sources`` (strings, files, run
directories, run.json, error files) · ``rootcause`` (which rank failed first and why) ·
``specifics`` (numbers from the log turned into advice) · ``enrich`` (this machine's GPUs)
· ``report`` (the result objects) · ``engine`` (the order of the steps).

Maps logs and torchelastic error files to causes and fixes; reads files (streaming) and
takes an optional inventory object. Never imports IPython, torch, pynvml or psutil.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING

from nbgpu.diagnose.catalog import CATALOG, CAUSE_IDS, UNKNOWN, Cause, Pattern, cause
from nbgpu.diagnose.engine import diagnose
from nbgpu.diagnose.report import Diagnosis, Evidence, FoundCause, RankSummary, SourceSummary

if TYPE_CHECKING:
    from nbgpu.devices.inventory import Inventory

__all__ = [
    "CATALOG",
    "CAUSE_IDS",
    "UNKNOWN",
    "Cause",
    "Diagnosis",
    "Evidence",
    "FoundCause",
    "Pattern",
    "RankSummary",
    "SourceSummary",
    "cause",
    "diagnose",
]


class _CallableModule(types.ModuleType):
    """This package's module type: calling the module calls :func:`diagnose`."""

    def __call__(
        self,
        source: object,
        *,
        inventory: Inventory | None = None,
        name: str | None = None,
        max_evidence: int = 5,
        full_scan: bool | None = None,
    ) -> Diagnosis:
        return diagnose(
            source, inventory=inventory, name=name, max_evidence=max_evidence, full_scan=full_scan
        )


sys.modules[__name__].__class__ = _CallableModule
