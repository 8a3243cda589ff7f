"""``%gpu_plan --widget``: the plan's inputs as controls, the plan redrawn as they change.

Every change builds a new plan with :func:`nbgpu.plan` (on one inventory snapshot taken
when the widget opens) and keeps it in the user's namespace (``p``), so the launch line
shown, ``%%torchrun --plan p --role train``, launches exactly what is on screen. A
:class:`~nbgpu.notebook.live.LiveView`: the controls above, the plan and its launch line
as the static face below, which a saved notebook keeps.
"""

from __future__ import annotations

import html
from typing import Any

from nbgpu._render import COLOURS, ROOT_STYLE
from nbgpu.errors import NbgpuError

__all__ = ["PlanWidget", "plan_inputs"]

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")


def plan_inputs(values: dict[str, Any]) -> dict[str, Any]:
    """The controls' values as :func:`nbgpu.plan` keyword arguments (0 and "" mean unset)."""
    inputs = {
        key: values.get(key, "").strip() or None for key in ("allocation", "exclude", "model")
    }
    for key in ("global_batch", "micro_batch", "grad_accum"):
        inputs[key] = max(0, int(values.get(key, 0))) or None
    return {**inputs, "strategy": values.get("strategy", "ddp")}


class PlanWidget:
    def __init__(
        self, namespace: dict[str, Any], *, name: str = "p", initial: dict[str, Any] | None = None
    ) -> None:
        import ipywidgets as w  # noqa: PLC0415

        from nbgpu.devices.inventory import take_inventory  # noqa: PLC0415

        self.namespace = namespace
        self.name = name
        self.inventory = take_inventory(scan_device_files=False)
        start = {"strategy": "ddp", **(initial or {})}
        style = {"description_width": "110px"}

        def text(key: str, description: str, placeholder: str) -> Any:
            return w.Text(
                value=start.get(key, ""),
                continuous_update=False,
                description=description,
                placeholder=placeholder,
                style=style,
            )

        def number(key: str, description: str, top: int) -> Any:
            return w.BoundedIntText(
                value=start.get(key, 0), min=0, max=top, description=description, style=style
            )

        self.controls: dict[str, Any] = {
            "allocation": text("allocation", "allocation", "d4 or sglang.d1t1p1+d3t1p1"),
            "exclude": text("exclude", "exclude GPUs", "e.g. 0,3"),
            "global_batch": number("global_batch", "global batch", 10**7),
            "micro_batch": number("micro_batch", "micro batch", 10**6),
            "grad_accum": number("grad_accum", "accumulation", 10**6),
            "strategy": w.Dropdown(
                options=STRATEGIES, value=start["strategy"], description="strategy", style=style
            ),
            "model": text("model", "model", "7B or Qwen/Qwen2.5-7B-Instruct"),
        }
        self.status = w.HTML()
        self.launch = w.Text(description="launch", layout=w.Layout(width="300px"))
        self.copy_button = w.Button(description="Copy", icon="copy", tooltip="copy the launch line")
        self.copy_out = w.Output()
        self.copy_button.on_click(lambda _b: self.copy())
        for control in self.controls.values():
            control.observe(lambda _c: self.update(), names="value")
        launch_row = w.HBox([self.launch, self.copy_button])
        self.box = w.VBox([*self.controls.values(), launch_row, self.status, self.copy_out])
        self.plan: Any = None
        self.error: str | None = None
        self.updates = 0
        self.view: Any = None  # set by show()
        self.update()

    def show(self) -> PlanWidget:
        from nbgpu.notebook.live import LiveView  # noqa: PLC0415

        self.view = LiveView(self.record, controls=self.box, interval_s=0.1)
        return self

    def update(self) -> None:
        """Rebuild the plan from the controls; an impossible combination is shown, not raised."""
        from nbgpu.plan import plan as make_plan  # noqa: PLC0415

        values = {key: control.value for key, control in self.controls.items()}
        try:
            plan = make_plan(inventory=self.inventory, **plan_inputs(values))
        except (NbgpuError, ValueError) as exc:
            self.plan, self.error = None, str(exc).splitlines()[0]
            self.status.value = f'<b style="color:#c62828">invalid: {html.escape(self.error)}</b>'
        else:
            self.plan, self.error = plan, None
            self.namespace[self.name] = plan
            state, colour = ("ready", "#2e7d32") if plan.ok else ("NOT READY", "#c62828")
            kept = f"kept as <code>{self.name}</code>"
            self.status.value = f'<b style="color:{colour}">{state}</b> · {kept}'
        self.launch.value = self.launch_line()  # none for an invalid plan
        self.updates += 1
        if self.view is not None:
            self.view.refresh()

    def launch_line(self) -> str:
        if self.plan is None:
            return ""
        train = next((r for r in self.plan.roles if r.kind == "train"), self.plan.roles[0])
        return f"%%torchrun --plan {self.name} --role {train.name}"

    def copy(self) -> None:
        from IPython.display import Javascript, display  # noqa: PLC0415

        line = self.launch_line()
        self.copy_out.clear_output()
        with self.copy_out:
            # The browser's clipboard; front ends that refuse it still show the line above.
            display(Javascript(f"navigator.clipboard && navigator.clipboard.writeText({line!r});"))

    def record(self) -> dict[str, str]:
        """The face: the plan on screen and its launch line (what a saved notebook shows)."""
        if self.plan is None:
            text = f"nbgpu plan widget: invalid: {self.error}"
            body = f'<b style="color:{COLOURS["bad"]}">{html.escape(text)}</b>'
            return {"text/plain": text, "text/html": f'<div style="{ROOT_STYLE}">{body}</div>'}
        return {
            "text/plain": f"{self.plan.text()}\nlaunch: {self.launch_line()}",
            "text/html": (
                f'<div class="nbgpu" style="{ROOT_STYLE}">{self.plan.html_body()}'
                f"<div>launch: <code>{html.escape(self.launch_line())}</code></div></div>"
            ),
        }
