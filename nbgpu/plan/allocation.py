"""Allocation strings: which roles a job has and how many GPUs each one needs.

Two spellings give the same :class:`Allocation`:

- AReaL's allocation mode (docs/en/reference/alloc_mode.md in github.com/inclusionAI/AReaL):
  parts ``[backend[name]:]dims`` joined by ``+`` (separate GPU pools) or ``|`` (colocated: the
  parts after the first run on its GPUs; ``|`` binds tighter: ``a+b|c`` is ``a + (b|c)``).
  Dimensions ``d`` (data), ``t`` (tensor; ``m`` is AReaL's older name), ``p`` (pipeline),
  ``c`` (context: splits the sequence, counts in the world size) and ``e`` (expert: places
  MoE experts inside the same GPUs, does not count), in any order, each at most once, missing
  ones 1: world size = d × t × p × c. The backend is followed by ``:`` or, in AReaL's older
  spelling, ``.`` (``sglang.d1t1p1+d3t1p1``); a bare ``d4t2`` is a trainer. Megatron's MoE
  form ``megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)`` lays attention and experts out differently
  over the same GPUs.
- roles with GPU counts: ``inference:1,train:3``. A role named like an inference engine
  or server (inference, rollout, gen, sglang, vllm, ...) is an inference role.

What AReaL refuses is refused here with the reason and the nearest form nbgpu plans: ``c``
or ``e`` on an inference engine, ``p``/``e`` on FSDP, colocated parts of different world
sizes, ``e`` that does not divide the GPUs of its part.

Order is kept: the first role owns logical device 0 of a job that shares one
``CUDA_VISIBLE_DEVICES`` (AReaL splits it by position). Pure parsing: never imports the
inventory, sockets or files.
"""

import re
from dataclasses import dataclass, replace

from nbgpu.errors import UserInputError

__all__ = ["Allocation", "RoleSpec", "parse_allocation"]

# Backends (AReaL part prefixes) and role names that mean "an inference server".
_INFERENCE_BACKENDS = frozenset({"sglang", "vllm", "trtllm", "tgi", "lmdeploy", "mock"})
_INFERENCE_NAMES = _INFERENCE_BACKENDS | {"inference", "infer", "rollout", "gen", "generation",
                                          "generator", "server", "serve"}  # fmt: skip
# AReaL's training backends, and the dimensions each one plans (its reference's tables).
_TRAIN_BACKENDS = {"fsdp": "dtc", "megatron": "dtpce", "archon": "dtpce"}
_INFERENCE_DIMS = "dtp"

_FORMS = (
    "expected [backend:]dims parts joined by '+' (separate GPUs) or '|' (shared GPUs), "
    "dims from d, t, p, c, e such as 'sglang:d1t1+fsdp:d3' or 'd4t1p1', or roles with "
    "GPU counts such as 'inference:1,train:3'"
)
_ROLES_FORM = re.compile(r"^\s*[A-Za-z_][\w-]*\s*:\s*\d+\s*(?:,\s*[A-Za-z_][\w-]*\s*:\s*\d+\s*)*$")
_PART = re.compile(r"^(?:([A-Za-z_][\w-]*)?(?:\[([A-Za-z_]\w*)\])?[.:])?((?:[dtmpceDTMPCE]\d+)+)$")
_MOE = re.compile(r"^([A-Za-z_][\w-]*)?(?:\[([A-Za-z_]\w*)\])?:\(?attn:(\w+)\|ffn:(\w+)\)?$")
_DEGREE = re.compile(r"([dtmpceDTMPCE])(\d+)")
_DEGREE_NAMES = {"d": "data-parallel", "t": "tensor-parallel", "p": "pipeline-parallel",
                 "c": "context-parallel", "e": "expert-parallel"}  # fmt: skip
# A role's field for each dimension letter: "d" → data_parallel.
_FIELDS = {k: name.replace("-", "_") for k, name in _DEGREE_NAMES.items()}


@dataclass(frozen=True)
class RoleSpec:
    """One role of a job as the user asked for it (no GPUs chosen yet)."""

    name: str  # unique in the allocation: "sglang", "train", "inference"
    kind: str  # "inference" | "train"
    backend: str | None  # "sglang", "vllm", "fsdp", ... as written; None if not given
    data_parallel: int
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1  # splits each sequence: counts in the world size
    expert_parallel: int = 1  # places MoE experts inside the same GPUs: does not count
    colocated_with: str | None = None  # the role whose GPUs this one shares ('|')

    @property
    def instance_gpus(self) -> int:
        """GPUs of one replica or server: t × p × c."""
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel

    @property
    def world_size(self) -> int:
        """GPUs the role's processes span: d × t × p × c (AReaL's world size)."""
        return self.data_parallel * self.instance_gpus

    @property
    def degrees(self) -> str:
        """``d4t2p1`` (plus ``c``/``e`` only when used): how plans and reports name a part."""
        text = f"d{self.data_parallel}t{self.tensor_parallel}p{self.pipeline_parallel}"
        extra = (("c", self.context_parallel), ("e", self.expert_parallel))
        return text + "".join(f"{k}{degree}" for k, degree in extra if degree > 1)

    @property
    def gpu_count(self) -> int:
        """GPUs of its own: its world size, or 0 when it shares another role's GPUs."""
        return 0 if self.colocated_with is not None else self.world_size


@dataclass(frozen=True)
class Allocation:
    """The roles of a job, in the order given (the first owns logical device 0)."""

    roles: tuple[RoleSpec, ...]

    @property
    def gpu_count(self) -> int:
        """GPUs the job needs: colocated roles add none."""
        return sum(r.gpu_count for r in self.roles)

    @property
    def text(self) -> str:
        """Canonical AReaL spelling: ``sglang.d1t1p1+d3t1p1``; ``|`` before colocated roles."""
        out = ""
        for n, role in enumerate(self.roles):
            prefix = f"{role.backend}." if role.backend else ""
            if not prefix and role.kind == "inference":
                prefix = f"{role.name}."
            elif role.name != _default_name(role.backend):
                # A name of its own is written, so the text reads back as the same roles.
                prefix = f"{role.backend or ''}[{role.name}]:"
            joint = "" if n == 0 else ("|" if role.colocated_with is not None else "+")
            out += joint + prefix + role.degrees
        return out

    @property
    def train_roles(self) -> tuple[RoleSpec, ...]:
        return tuple(r for r in self.roles if r.kind == "train")

    @property
    def colocated(self) -> bool:
        return any(r.colocated_with is not None for r in self.roles)

    def with_data_parallel(self, name: str, data_parallel: int) -> "Allocation":
        roles = (
            replace(r, data_parallel=data_parallel) if r.name == name else r for r in self.roles
        )
        return Allocation(tuple(roles))


def _default_name(backend: str | None) -> str:
    """A part without a name: an inference engine is named by its backend, a trainer 'train'."""
    return backend.lower() if backend and _kind_of(backend) == "inference" else "train"


def _kind_of(name: str | None) -> str:
    return "inference" if name is not None and name.lower() in _INFERENCE_NAMES else "train"


def _parse_roles(text: str) -> Allocation:
    items = (item.partition(":") for item in text.split(","))
    pairs = [(name.strip(), int(number)) for name, _, number in items]
    lowered = [name.lower() for name, _ in pairs]
    for name, _ in pairs:
        if lowered.count(name.lower()) > 1:
            raise UserInputError(
                f"roles {text!r}: role {name!r} is listed twice; give each role once "
                "with its GPU count, e.g. 'inference:1,train:3'"
            )
    for name, count in pairs:
        if count < 1:
            raise UserInputError(
                f"roles {text!r}: {name}:{count} has no GPU; every role needs at least 1"
            )
    return Allocation(tuple(RoleSpec(name, _kind_of(name), None, count) for name, count in pairs))


def _degrees(text: str, part: str, degree_text: str) -> dict[str, int]:
    degrees: dict[str, int] = {}
    for letter, number in _DEGREE.findall(degree_text):
        key = {"m": "t"}.get(letter.lower(), letter.lower())
        if key in degrees:
            raise UserInputError(
                f"allocation {text!r}: {part!r} gives the {_DEGREE_NAMES[key]} degree twice; "
                "write each of d, t, p, c, e at most once, e.g. d2t2p1"
            )
        value = int(number)
        if value < 1:
            raise UserInputError(
                f"allocation {text!r}: {letter}{number} in {part!r} is not a degree; "
                "degrees are whole numbers >= 1"
            )
        degrees[key] = value
    return degrees


def _split_top(text: str, sep: str) -> list[str]:
    """Split at each *sep* with no ``)`` before the next ``(``: Megatron's ``(attn:..|ffn:..)``."""
    return re.split(rf"{re.escape(sep)}(?![^(]*\))", text)


def _dims(degrees: dict[str, int]) -> str:
    return "".join(f"{k}{degrees[k]}" for k in "dtpce" if k in degrees) or "d1"


def _check_backend(text: str, part: str, backend: str | None, degrees: dict[str, int]) -> None:
    """What AReaL's backends plan: refuse the rest with the nearest form that works."""
    used = {k for k, v in degrees.items() if v > 1}
    name = (backend or "").lower()
    if name in _INFERENCE_BACKENDS:
        bad = sorted(used - set(_INFERENCE_DIMS), key="dtpce".index)
        if bad:
            kept = {k: v for k, v in degrees.items() if k in _INFERENCE_DIMS}
            raise UserInputError(
                f"allocation {text!r}: {part!r}: an inference engine takes d, t and p; "
                f"{_listing(bad)} {'is a training dimension' if len(bad) == 1 else 'are training dimensions'} "
                f"in AReaL; nearest form: '{backend}:{_dims(kept)}'"
            )
    allowed = _TRAIN_BACKENDS.get(name)
    if allowed is not None:
        bad = sorted(used - set(allowed), key="dtpce".index)
        if bad:
            raise UserInputError(
                f"allocation {text!r}: {part!r}: {name} plans d, t and c; {_listing(bad)} "
                f"{'needs' if len(bad) == 1 else 'need'} megatron or archon; "
                f"nearest form: 'megatron:{_dims(degrees)}'"
            )
    expert = degrees.get("e", 1)
    if expert > 1:
        mesh = degrees.get("d", 1) * degrees.get("t", 1) * degrees.get("c", 1)
        if mesh % expert:
            fits = max(k for k in range(1, min(mesh, expert) + 1) if mesh % k == 0)
            raise UserInputError(
                f"allocation {text!r}: {part!r}: expert-parallel e{expert} must divide the "
                f"GPUs of one pipeline stage (d × t × c = {mesh}); e.g. e{fits}"
            )


def _listing(letters: list[str]) -> str:
    return " and ".join(f"{_DEGREE_NAMES[b]} ({b})" for b in letters)


def _parse_moe(
    text: str, part: str, m: re.Match[str]
) -> tuple[str | None, str | None, dict[str, int]]:
    """``megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)``: one role, attention's mesh, ffn checked."""
    backend, name = m.group(1), m.group(2)
    attn = _degrees(text, part, m.group(3))
    ffn = _degrees(text, part, m.group(4))
    if "e" in attn or "c" in ffn:
        raise UserInputError(
            f"allocation {text!r}: {part!r}: e goes in the ffn section and c in the attn "
            "section, e.g. 'megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)'"
        )
    if attn.get("p", 1) != ffn.get("p", 1):
        raise UserInputError(
            f"allocation {text!r}: {part!r}: attn and ffn need the same pipeline degree "
            f"(p{attn.get('p', 1)} vs p{ffn.get('p', 1)})"
        )
    world = attn.get("d", 1) * attn.get("t", 1) * attn.get("p", 1) * attn.get("c", 1)
    rest = ffn.get("t", 1) * ffn.get("p", 1) * ffn.get("e", 1)
    if "d" not in ffn and world % rest == 0:
        ffn["d"] = world // rest  # derived, as AReaL does when ffn omits d
    if ffn.get("d", 1) * rest != world:
        raise UserInputError(
            f"allocation {text!r}: {part!r}: attn spans {world} GPUs but ffn "
            f"{ffn.get('d', 1) * rest} (d × t × p × e); both sections lay out the same GPUs"
        )
    return backend, name, {**attn, "e": ffn.get("e", 1)}


def _parse_part(text: str, part: str) -> tuple[str | None, str | None, dict[str, int]]:
    moe = _MOE.match(part)
    if moe is not None:
        backend, name, degrees = _parse_moe(text, part, moe)
    else:
        m = _PART.match(part)
        if m is None:
            raise UserInputError(f"allocation {text!r}: cannot read {part!r}; {_FORMS}")
        backend, name = m.group(1), m.group(2)
        degrees = _degrees(text, part, m.group(3))
    _check_backend(text, part, backend, degrees)
    return backend, name, degrees


def parse_allocation(text: str) -> Allocation:
    """Parse either spelling; a malformed string raises one ``UserInputError`` line."""
    if not isinstance(text, str) or not text.strip():
        raise UserInputError(f"allocation {text!r} is empty; {_FORMS}")
    stripped = text.strip()
    if _ROLES_FORM.match(stripped):
        return _parse_roles(stripped)
    parsed: list[tuple[str | None, str | None, dict[str, int], int | None]] = []
    for component in _split_top(stripped.replace(" ", ""), "+"):
        anchor: int | None = None
        for part in _split_top(component, "|"):
            if not part:
                raise UserInputError(f"allocation {text!r} has an empty part; {_FORMS}")
            if part.lower() in ("eval", "cpu"):
                raise UserInputError(
                    f"allocation {text!r}: '+{part}' runs on CPU and needs no GPU plan; "
                    "leave it out, e.g. 'sglang.d4t1p1'"
                )
            backend, name, degrees = _parse_part(text, part)
            parsed.append((backend, name, degrees, anchor))
            if anchor is None:
                anchor = len(parsed) - 1
    given = [name or _default_name(backend) for backend, name, _, _ in parsed]
    # "d2t1p1+d2t1p1" has two unnamed trainers: train, train2 (a plan needs distinct names).
    seen = [given[: n + 1].count(name) for n, name in enumerate(given)]
    names = [name if k == 1 else f"{name}{k}" for name, k in zip(given, seen, strict=True)]
    roles: list[RoleSpec] = []
    for (backend, _name, degrees, anchor), role_name in zip(parsed, names, strict=True):
        role = RoleSpec(
            name=role_name,
            kind=_kind_of(backend) if backend else _kind_of(_name),
            backend=backend.lower() if backend else None,
            colocated_with=None if anchor is None else names[anchor],
            **{field: degrees.get(k, 1) for k, field in _FIELDS.items()},
        )
        if anchor is not None and role.world_size != roles[anchor].world_size:
            first = roles[anchor]
            raise UserInputError(
                f"allocation {text!r}: colocated parts share the same GPUs, so they need the "
                f"same world size: {first.name} spans {first.world_size} GPUs, {role.name} "
                f"{role.world_size}; e.g. '{_same_world(first, role)}', or '+' for separate GPUs"
            )
        roles.append(role)
    return Allocation(tuple(roles))


def _same_world(first: RoleSpec, role: RoleSpec) -> str:
    """The colocated pair with the second part's data degree fitted to the first's GPUs."""
    degree = max(1, first.world_size // role.instance_gpus)
    fitted = replace(role, data_parallel=degree)
    head = f"{first.backend}:" if first.backend else ""
    tail = f"{role.backend}:" if role.backend else ""
    return f"{head}{_short(first)}|{tail}{_short(fitted)}"


def _short(role: RoleSpec) -> str:
    return _dims({k: getattr(role, name) for k, name in _FIELDS.items() if getattr(role, name) > 1})
