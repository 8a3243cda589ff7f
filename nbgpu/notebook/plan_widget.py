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
# A long allocation in the message breaks where it must instead of widening the cell.
_ERROR_STYLE = f"color:{COLOURS['bad']};overflow-wrap:anywhere"


#: The keywords of :func:`nbgpu.plan` the controls set: text, then whole numbers.
TEXT_INPUTS = ("allocation", "exclude", "model")
NUMBER_INPUTS = ("global_batch", "micro_batch", "grad_accum", "seq_len")


def plan_inputs(values: dict[str, Any]) -> dict[str, Any]:
    """The controls' values as :func:`nbgpu.plan` keyword arguments (0 and "" mean unset)."""
    inputs = {key: values.get(key, "").strip() or None for key in TEXT_INPUTS}
    for key in NUMBER_INPUTS:
        inputs[key] = max(0, int(values.get(key, 0))) or None
    return {**inputs, "strategy": values.get("strategy", "ddp")}


class PlanWidget:
    """*keywords* are :func:`nbgpu.plan`'s (``%gpu_plan``'s flags): the controls start from
    them and override the ones they show; the rest (``--fleet``, ``--max-micro``, ...) hold."""

    def __init__(
        self, namespace: dict[str, Any], keywords: dict[str, Any] | None = None, *, name: str = "p"
    ) -> None:
        import ipywidgets as w  # noqa: PLC0415

        from nbgpu.plan.api import inventory_snapshot  # noqa: PLC0415

        self.namespace = namespace
        self.name = name
        self.keywords = {"strategy": "ddp", **(keywords or {})}
        # One snapshot (of --fleet, or of this machine) for every redraw.
        self.keywords["inventory"] = inventory_snapshot(self.keywords.get("inventory"), None)
        start = {k: v for k, v in self.keywords.items() if v is not None}
        style = {"description_width": "110px"}
        wide = w.Layout(width="auto", max_width="420px")

        def text(key: str, description: str, placeholder: str) -> Any:
            return w.Text(
                value=str(start.get(key, "")),
                continuous_update=False,
                description=description,
                placeholder=placeholder,
                style=style,
                layout=wide,
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
            "seq_len": number("seq_len", "seq len", 10**7),
            "strategy": w.Dropdown(
                options=STRATEGIES, value=start["strategy"], description="strategy", style=style
            ),
            "model": text("model", "model", "7B or Qwen/Qwen2.5-7B-Instruct"),
        }
        self.status = w.HTML()
        # The launch line takes the room there is; Copy keeps its own (never "…").
        self.launch = w.Text(
            description="launch", style=style, layout=w.Layout(flex="1 1 auto", width="auto")
        )
        self.copy_button = w.Button(
            description="Copy",
            icon="copy",
            tooltip="copy the launch line",
            layout=w.Layout(flex="0 0 auto", width="auto"),
        )
        self.copy_out = w.Output()
        self.copy_button.on_click(lambda _b: self.copy())
        for control in self.controls.values():
            control.observe(lambda _c: self.update(), names="value")
        launch_row = w.HBox([self.launch, self.copy_button], layout=wide)
        self.box = w.VBox(
            [*self.controls.values(), launch_row, self.status, self.copy_out],
            layout=w.Layout(overflow="hidden"),
        )
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
            plan = make_plan(**{**self.keywords, **plan_inputs(values)})
        except (NbgpuError, ValueError) as exc:
            self.plan, self.error = None, str(exc).splitlines()[0]
            # The plan below says why (once); the controls say only that it is invalid.
            self.status.value = f'<b style="{_ERROR_STYLE}">invalid: see below</b>'
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
            body = f'<b style="{_ERROR_STYLE}">{html.escape(text)}</b>'
            return {"text/plain": text, "text/html": f'<div style="{ROOT_STYLE}">{body}</div>'}
        return {
            "text/plain": f"{self.plan.text()}\nlaunch: {self.launch_line()}",
            "text/html": (
                f'<div class="nbgpu" style="{ROOT_STYLE}">{self.plan.html_body()}'
                f"<div>launch: <code>{html.escape(self.launch_line())}</code></div></div>"
            ),
        }
