"""Allocation strings: which roles a job has and how many GPUs each one needs.

Two spellings are accepted and give the same :class:`Allocation`:

- AReaL's allocation mode, ``[backend.]dNtNpN`` parts joined by ``+``:
  ``sglang.d1t1p1+d3t1p1`` (one SGLang server GPU, three data-parallel trainers),
  ``vllm.d2t2p1+d4t1p1``, ``d4t1p1``. The degrees ``d`` (data), ``t`` (tensor; ``m`` is
  AReaL's older name for it) and ``p`` (pipeline) come in any order, each at most once,
  missing ones are 1; ``:`` works as well as ``.`` after the backend (``sglang:d4t2``).
  A part whose backend is an inference engine (sglang, vllm, ...) is an inference role;
  any other part is a training role.
- roles with GPU counts: ``inference:1,train:3``. A role named like an inference engine
  or server (inference, rollout, gen, sglang, vllm, ...) is an inference role.

The role listed first owns logical device 0 of a job that shares one
``CUDA_VISIBLE_DEVICES`` (AReaL splits it by position), which is why order is kept.

Pure parsing: imports only ``nbgpu.errors``; never the inventory, sockets or files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from nbgpu.errors import UserInputError

__all__ = [
    "INFERENCE_BACKENDS",
    "Allocation",
    "RoleSpec",
    "parse_allocation",
]

#: Backends (AReaL part prefixes) and role names that mean "an inference server".
INFERENCE_BACKENDS = frozenset({"sglang", "vllm", "trtllm", "tgi", "lmdeploy", "mock"})
_INFERENCE_NAMES = INFERENCE_BACKENDS | {
    "inference",
    "infer",
    "rollout",
    "gen",
    "generation",
    "generator",
    "server",
    "serve",
}

_FORMS = (
    "expected [backend.]dNtNpN parts joined by '+', e.g. 'sglang.d1t1p1+d3t1p1' or "
    "'d4t1p1', or roles with GPU counts such as 'inference:1,train:3'"
)
_ROLES_FORM = re.compile(r"^\s*[A-Za-z_][\w-]*\s*:\s*\d+\s*(?:,\s*[A-Za-z_][\w-]*\s*:\s*\d+\s*)*$")
_PART = re.compile(r"^(?:([A-Za-z_][\w-]*)[.:])?((?:[dtmpDTMP]\d+)+)$")
_DEGREE = re.compile(r"([dtmpDTMP])(\d+)")


@dataclass(frozen=True)
class RoleSpec:
    """One role of a job as the user asked for it (no GPUs chosen yet)."""

    name: str  # unique in the allocation: "sglang", "train", "inference"
    kind: str  # "inference" | "train"
    backend: str | None  # "sglang", "vllm", "fsdp", ... as written; None if not given
    data_parallel: int
    tensor_parallel: int = 1
    pipeline_parallel: int = 1

    @property
    def gpu_count(self) -> int:
        return self.data_parallel * self.tensor_parallel * self.pipeline_parallel

    @property
    def degrees(self) -> str:
        return f"d{self.data_parallel}t{self.tensor_parallel}p{self.pipeline_parallel}"


@dataclass(frozen=True)
class Allocation:
    """The roles of a job, in the order given (the first owns logical device 0)."""

    roles: tuple[RoleSpec, ...]

    @property
    def gpu_count(self) -> int:
        return sum(r.gpu_count for r in self.roles)

    @property
    def text(self) -> str:
        """Canonical AReaL spelling: ``sglang.d1t1p1+d3t1p1``; trainers without backend."""
        parts = []
        for role in self.roles:
            prefix = f"{role.backend}." if role.backend else ""
            if not prefix and role.kind == "inference":
                prefix = f"{role.name}."
            parts.append(prefix + role.degrees)
        return "+".join(parts)

    @property
    def train_roles(self) -> tuple[RoleSpec, ...]:
        return tuple(r for r in self.roles if r.kind == "train")

    def with_data_parallel(self, name: str, data_parallel: int) -> Allocation:
        """The same allocation with role *name* at another data-parallel degree."""
        return Allocation(
            tuple(
                RoleSpec(
                    r.name, r.kind, r.backend, data_parallel, r.tensor_parallel, r.pipeline_parallel
                )
                if r.name == name
                else r
                for r in self.roles
            )
        )


def _kind_of(name: str | None) -> str:
    return "inference" if name is not None and name.lower() in _INFERENCE_NAMES else "train"


def _unique(names: list[str]) -> list[str]:
    # "d2t1p1+d2t1p1" has two unnamed trainers: train, train2 (a plan needs distinct names).
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}{seen[name]}")
    return out


def _parse_roles(text: str) -> Allocation:
    names: list[str] = []
    counts: list[int] = []
    for item in text.split(","):
        name, _, number = item.partition(":")
        names.append(name.strip())
        counts.append(int(number))
    lowered = [n.lower() for n in names]
    for name in names:
        if lowered.count(name.lower()) > 1:
            raise UserInputError(
                f"roles {text!r}: role {name!r} is listed twice; give each role once "
                "with its GPU count, e.g. 'inference:1,train:3'"
            )
    for name, count in zip(names, counts, strict=True):
        if count < 1:
            raise UserInputError(
                f"roles {text!r}: {name}:{count} has no GPU; every role needs at least 1"
            )
    return Allocation(
        tuple(
            RoleSpec(name, _kind_of(name), None, count)
            for name, count in zip(names, counts, strict=True)
        )
    )


def _parse_part(text: str, part: str) -> tuple[str | None, dict[str, int]]:
    m = _PART.match(part)
    if m is None:
        raise UserInputError(f"allocation {text!r}: cannot read {part!r}; {_FORMS}")
    backend, degree_text = m.group(1), m.group(2)
    degrees: dict[str, int] = {}
    for letter, number in _DEGREE.findall(degree_text):
        key = {"m": "t"}.get(letter.lower(), letter.lower())
        if key in degrees:
            raise UserInputError(
                f"allocation {text!r}: {part!r} gives the {_DEGREE_NAMES[key]} degree twice; "
                "write each of d, t, p at most once, e.g. d2t2p1"
            )
        value = int(number)
        if value < 1:
            raise UserInputError(
                f"allocation {text!r}: {letter}{number} in {part!r} is not a degree; "
                "degrees are whole numbers >= 1"
            )
        degrees[key] = value
    return backend, degrees


_DEGREE_NAMES = {"d": "data-parallel", "t": "tensor-parallel", "p": "pipeline-parallel"}


def parse_allocation(text: str) -> Allocation:
    """Parse either spelling; a malformed string raises one ``UserInputError`` line."""
    if not isinstance(text, str) or not text.strip():
        raise UserInputError(f"allocation {text!r} is empty; {_FORMS}")
    stripped = text.strip()
    if _ROLES_FORM.match(stripped):
        return _parse_roles(stripped)
    if "|" in stripped:
        raise UserInputError(
            f"allocation {text!r}: '|' places roles on the same GPUs (colocated); nbgpu plans "
            "roles on disjoint GPUs: join parts with '+', e.g. 'vllm.d2t2p1+d4t1p1'"
        )
    names: list[str] = []
    specs: list[tuple[str | None, dict[str, int]]] = []
    for part in stripped.replace(" ", "").split("+"):
        if not part:
            raise UserInputError(f"allocation {text!r} has an empty part; {_FORMS}")
        if part.lower() in ("eval", "cpu"):
            raise UserInputError(
                f"allocation {text!r}: '+{part}' runs on CPU and needs no GPU plan; "
                "leave it out, e.g. 'sglang.d4t1p1'"
            )
        backend, degrees = _parse_part(text, part)
        specs.append((backend, degrees))
        names.append(backend.lower() if backend else "train")
    roles = tuple(
        RoleSpec(
            name=name,
            kind=_kind_of(backend),
            backend=backend.lower() if backend else None,
            data_parallel=degrees.get("d", 1),
            tensor_parallel=degrees.get("t", 1),
            pipeline_parallel=degrees.get("p", 1),
        )
        for name, (backend, degrees) in zip(_unique(names), specs, strict=True)
    )
    return Allocation(roles)
