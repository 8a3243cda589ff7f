"""Hardware knowledge only: NVML, fleets and their simulation, inventory, holders,
the CUDA probe, findings, doctor and clean. Imports nothing from the other layers."""

__all__: list[str] = []
