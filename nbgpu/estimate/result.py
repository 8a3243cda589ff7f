"""An estimate's named terms (bytes per GPU, formula, source) and the estimate itself,
analytic and traced side by side; the sourced figures and the layout the formulas read;
:class:`StepComparison`, one measured step beside both. Pure data; never imports torch.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nbgpu._render import Block, Bullets, Figure, Line, Result, Table, Title, to_text, wrap
from nbgpu.sizes import fmt_bytes

__all__ = ["CUDA_CONTEXT_BYTES", "FRAGMENTATION", "NCCL_BYTES_PER_GROUP", "PER_SAMPLE", "ROLES",
           "Layout", "MemoryEstimate", "StepComparison", "Term"]  # fmt: skip

GiB = 1024**3
#: CUDA context per process: 287 MB lazy vs 667 MB eager loading (PyTorch PR #86509);
#: "~400MB with lazy loading" (issue #109888). Mid-range of the 0.3-0.6 GB reported across drivers.
CUDA_CONTEXT_BYTES = GiB // 2
#: NCCL buffers per communicator: 544/688 MB measured on 4×A100 (NCCL issue #964);
#: budget 0.5-1 GiB per communicator. A planning heuristic, stated as such.
NCCL_BYTES_PER_GROUP = 3 * GiB // 4
#: Fragmentation margin on the allocator's share (reserved - allocated):
#: plan 5-10 %; Lightning's finder keeps 5 %, accelerate's 10 %.
FRAGMENTATION = 0.05

ROLES = ("train", "inference")

# Which terms scale with the micro batch (the rest is fixed per GPU); a trace's transient
# buffers grow with it too.
PER_SAMPLE = frozenset({"activations", "logits/loss", "KV cache", "temporaries"})


@dataclass(frozen=True)
class Term:
    """One named part of per-GPU memory; ``bytes_per_gpu`` None: not computable here."""

    name: str
    bytes_per_gpu: int | None
    formula: str
    source: str
    kind: str  # "model states", "activations", "kv", "reserve", "margin"; "host": not on the GPU


@dataclass(frozen=True)
class Layout:
    """How the model runs: what an estimate is of (its JSON's words) and the formulas' knobs."""

    role: str
    precision: str
    optimizer: str
    strategy: str
    world_size: int
    data_parallel: int
    tensor_parallel: int
    pipeline_parallel: int
    micro_batch: int
    seq_len: int | None
    activation_checkpointing: bool
    flash_attention: bool
    gradient_as_bucket_view: bool
    fragmentation: float
    kv_tokens: int | None  # KV-cache tokens per GPU (inference); None: micro × seq
    foreach: bool = True  # traced optimizer: PyTorch's CUDA default (False: its CPU default)
    grad_dtype: str = "bf16"  # the gradients' precision (fp32 under Megatron-LM's bf16)
    offload: tuple[str, ...] = ()  # on the host: "optimizer" and/or "params"
    gpus_per_node: int = 1  # ranks sharing one host's memory

    @property
    def model_parallel(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel


# The formulas' knobs: an estimate's JSON leaves them out (it has the layout's words).
_KNOBS = ("gradient_as_bucket_view", "fragmentation", "kv_tokens", "foreach")


@dataclass(frozen=True)
class MemoryEstimate(Result):
    model: str  # how the model was given: "7.5B parameters", "Qwen/Qwen2.5-7B-Instruct"
    parameters: int
    layout: Layout
    terms: tuple[Term, ...]  # analytic
    traced_terms: tuple[Term, ...] = ()  # empty: not traced
    trace_note: str = ""  # which tool traced, or why tracing failed / was not tried
    budget_bytes: int | None = None
    max_micro_batch: int | None = None  # the largest micro batch within budget_bytes
    notes: tuple[str, ...] = ()
    JSON_EXTRAS = ("method", "analytic_bytes", "traced_bytes", "total_bytes", "host_bytes", "fits")
    FRAME_COLUMNS = ("term", "kind", "analytic_bytes", "traced_bytes", "formula", "source")

    @staticmethod
    def _sum(terms: Sequence[Term]) -> int:
        return sum(t.bytes_per_gpu or 0 for t in terms if t.kind != "host")

    @property
    def host_bytes(self) -> int:  # one rank's host memory (offload); × gpus_per_node per node
        return sum(t.bytes_per_gpu or 0 for t in self.terms if t.kind == "host")

    @property
    def analytic_bytes(self) -> int:
        return self._sum(self.terms)

    @property
    def traced_bytes(self) -> int | None:
        return self._sum(self.traced_terms) if self.traced_terms else None

    @property
    def total_bytes(self) -> int:
        """The answer: traced when a trace succeeded, else analytic."""
        return self._sum(self.traced_terms or self.terms)

    @property
    def method(self) -> str:
        return "traced" if self.traced_terms else "analytic"

    @property
    def model_state_bytes(self) -> int:
        return self._sum([t for t in self.terms if t.kind == "model states"])

    @property
    def fits(self) -> bool | None:
        return None if self.budget_bytes is None else self.total_bytes <= self.budget_bytes

    def term(self, name: str, traced: bool = False) -> Term | None:
        return next(
            (t for t in (self.traced_terms if traced else self.terms) if t.name == name), None
        )

    def _sources(self) -> dict[str, int]:
        """Each distinct source, numbered for the text view's ``[n]`` marks."""
        every = [t.source for t in (*self.terms, *self.traced_terms)]
        return {src: n for n, src in enumerate(dict.fromkeys(every), 1)}

    def _table(self) -> Table:
        traced, numbers = bool(self.traced_terms), self._sources()
        headers = ["term", "analytic"] + (["traced"] if traced else []) + ["formula"]
        table = Table(headers, flex=len(headers) - 1)
        for row in self.records():  # analytic terms, then traced-only ones (temporaries)
            analytic = "?" if row["analytic_bytes"] is None else fmt_bytes(row["analytic_bytes"])
            if self.term(row["term"]) is None:
                analytic = "-"
            cells = [f"{row['term']} [{numbers[row['source']]}]", analytic]
            if traced:
                cells.append(fmt_bytes(row["traced_bytes"]))
            table.add(*cells, row["formula"], level="warn" if analytic == "?" else "")
        total = ["total per GPU", fmt_bytes(self.analytic_bytes)]
        if traced:
            total.append(fmt_bytes(self.traced_bytes))
        table.add(*total, "", level="bad" if self.fits is False else "")
        return table

    def _heading(self) -> str:
        lay = self.layout
        mp = f" (dp {lay.data_parallel} × tp {lay.tensor_parallel} × pp {lay.pipeline_parallel})"
        par = (f"{lay.strategy}, " if lay.role == "train" else "") + f"world size {lay.world_size}"
        par += mp if lay.model_parallel > 1 else ""
        seq = f" × seq {lay.seq_len}" if lay.seq_len else " (seq_len not given)"
        ckpt = ", activation checkpointing" if lay.activation_checkpointing else ""
        attention = "flash attention" if lay.flash_attention else "attention scores materialised"
        extra = [f"{lay.grad_dtype} grads"] if lay.grad_dtype != lay.precision else []
        extra += [f"{'+'.join(lay.offload)} offloaded to the host"] if lay.offload else []
        return (
            f"memory estimate ({self.method}): {self.model} ({self.parameters:,} parameters), "
            f"{lay.role}, {lay.precision}{' ' + lay.optimizer if lay.role == 'train' else ''}, "
            f"{par}, micro batch {lay.micro_batch}{seq}{ckpt}, " + ", ".join([attention, *extra])
        )

    def _footer(self) -> list[str]:
        lines = []
        if self.budget_bytes is not None:
            verdict = f"{fmt_bytes(self.total_bytes)} {'fits' if self.fits else 'does NOT fit'}"
            lines.append(f"budget {fmt_bytes(self.budget_bytes)} per GPU: {verdict}")
        if self.max_micro_batch is not None:
            lines.append(f"largest micro batch within the budget: {self.max_micro_batch}")
        if self.host_bytes:
            node = self.layout.gpus_per_node
            lines.append(
                f"host memory (not in the GPU total): {fmt_bytes(self.host_bytes)} per rank, "
                f"{fmt_bytes(self.host_bytes * node)} per node of {node} ranks"
            )
        if self.trace_note:
            lines.append(self.trace_note)
        if self.traced_terms:
            lines.append(
                "traced column: bytes per MemTracker category at the step's peak moment "
                "(memory that is free at that moment, e.g. gradients set to None, shows 0)"
            )
        if uncounted := [t.name for t in self.terms if t.bytes_per_gpu is None]:
            lines.append(
                "analytic terms not computable without the model's shape or seq_len: "
                f"{', '.join(uncounted)} (pass a model name or an HF config.json, and seq_len)"
            )
        lines.extend(self.notes)
        return lines

    def to_dict(self) -> dict[str, Any]:
        # Flat, as users parse it: the layout's words next to the model, not its knobs.
        data = super().to_dict()
        words = {k: v for k, v in data.pop("layout").items() if k not in _KNOBS}
        return {"model": self.model, "parameters": self.parameters, **words, **data}

    def text(self) -> str:
        return to_text(self.content(), width=100)  # formulas and sources are long

    def content(self) -> list[Block]:
        sources = [f"[{n}] {src}" for src, n in self._sources().items()]
        return [
            Title(wrap(self._heading(), "")),
            Figure(alt="", svg=self._bar_html()),  # the terms as one stacked bar
            self._table(),
            *(Line(line) for line in self._footer()),
            Bullets(sources, title="sources:", marker="  "),
        ]

    def _bar_html(self) -> str:
        """One stacked bar of the answer's terms against the budget (static HTML)."""
        import html  # noqa: PLC0415

        scale = max(self.total_bytes, self.budget_bytes or 0) or 1
        colours = {"model states": "#4e79a7", "activations": "#f28e2b", "kv": "#59a14f"}
        colours |= {"reserve": "#9c755f", "margin": "#bab0ac"}  # not "host": off the GPU
        drawn = self.traced_terms or self.terms
        terms = [t for t in drawn if t.bytes_per_gpu and t.kind in colours]
        parts = []
        for t in terms:
            width = 100 * (t.bytes_per_gpu or 0) / scale
            label = html.escape(f"{t.name}: {fmt_bytes(t.bytes_per_gpu)}")
            parts.append(
                f'<div title="{label}" style="display:inline-block;height:14px;'
                f'width:{width:.2f}%;background:{colours.get(t.kind, "#888")}"></div>'
            )
        legend = " ".join(
            f'<span style="color:{c}">&#9632;</span> {html.escape(k)}' for k, c in colours.items()
        )
        marker = ""
        if self.budget_bytes:
            left = 100 * self.budget_bytes / scale
            marker = (
                f'<div title="budget {fmt_bytes(self.budget_bytes)}" style="position:absolute;'
                f'top:0;left:{left:.2f}%;height:14px;border-left:2px solid #c0392b"></div>'
            )
            legend += ' <span style="color:#c0392b">|</span> budget'
        return (
            '<div style="position:relative;width:100%;max-width:640px;white-space:nowrap;'
            f'background:#eee;margin:4px 0;font-size:0">{"".join(parts)}{marker}</div>'
            f"<div>{legend}</div>"
        )

    def records(self) -> list[dict[str, Any]]:
        traced = {t.name: t for t in self.traced_terms}
        only_traced = [t for name, t in traced.items() if self.term(name) is None]
        rows = []
        for t in (*self.terms, *only_traced):
            pair = (self.term(t.name), traced.get(t.name))  # analytic, traced
            counts = (None if u is None else u.bytes_per_gpu for u in pair)
            row = (t.name, t.kind, *counts, t.formula, t.source)
            rows.append(dict(zip(self.FRAME_COLUMNS, row, strict=True)))
        return rows


@dataclass(frozen=True)
class StepComparison(Result):
    """Measured peak tensor bytes of one real CPU step beside the traced and analytic ones."""

    model: str
    batch_shape: str
    measured_bytes: int
    traced_bytes: int | None
    analytic_bytes: int | None  # model states + activations formulas (None: no shape)
    trace_note: str
    measure_seconds: float
    FRAME_COLUMNS = ("method", "bytes", "error_vs_measured")

    def _error(self, value: int | None) -> float | None:
        if value is None or not self.measured_bytes:
            return None
        return (value - self.measured_bytes) / self.measured_bytes

    def records(self) -> list[dict[str, Any]]:
        return [
            {"method": m, "bytes": v, "error_vs_measured": self._error(v)}
            for m, v in (
                ("measured (CPU step, profiler)", self.measured_bytes),
                ("traced (fake tensors)", self.traced_bytes),
                ("analytic (formulas)", self.analytic_bytes),
            )
        ]

    def content(self) -> list[Block]:
        table = Table(["method", "peak tensor bytes", "vs measured"])
        for r in self.records():
            err = r["error_vs_measured"]
            table.add(r["method"], fmt_bytes(r["bytes"]), "-" if err is None else f"{err:+.1%}")
        head = f"one training step of {self.model}, batch {self.batch_shape}"
        return [Title(head), table, Line(self.trace_note)]
