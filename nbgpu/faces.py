"""Hints name the face the user is in: a command a message suggests is one the user can
type where they are (``%%torchrun 4``, ``nbgpu run -n 4``, ``nbgpu.torchrun(code, 4)``).
"""

__all__ = ["FACES", "doctor_hint", "launch_hint"]

FACES = ("notebook", "terminal", "python")


def launch_hint(
    face: str, nproc: int | None = None, *, gpus: str | None = None, force: bool = False
) -> str:
    """The launch command with these choices, as the user would type it in *face*."""
    python = face == "python"
    terminal = face == "terminal"
    parts = ["code" if python else "nbgpu run" if terminal else "%%torchrun"]
    if nproc is not None:
        parts.append(f"-n {nproc}" if terminal else str(nproc))
    if gpus:
        parts.append(f'gpus="{gpus}"' if python else f"--gpus {gpus}")
    if force:
        parts.append("force=True" if python else "--force")
    if python:
        return f"nbgpu.torchrun({', '.join(parts)})"
    return " ".join([*parts, "script.py"] if terminal else parts)


def doctor_hint(face: str) -> str:
    return "nbgpu doctor" if face == "terminal" else "%gpu_doctor"
