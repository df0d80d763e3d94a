"""What a check found: a row per run, the report, and its text form."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from session_server.splice import GENERIC


@dataclass(slots=True)
class Row:
    name: str
    api: str
    stream: bool
    naive_contiguous: bool
    contiguous: bool
    reason: str | None
    naive_reason: str | None = None
    tokenkeep_reason: str | None = None
    calls_parsed: bool | None = None
    """A scripted tool call came back as a call (None: the scenario has none)."""
    stream_equal: bool | None = None
    """The streamed reply assembled equals the non-streamed one (None: not compared)."""
    first_reply: dict[str, Any] | None = None


@dataclass(slots=True)
class Report:
    model: str
    renderer: str
    rows: list[Row] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    path_reason: str = ""

    @property
    def contiguous(self) -> bool:
        """Every run kept token-exact (no run at all is no verdict: not contiguous)."""
        return bool(self.rows) and all(r.contiguous for r in self.rows)

    @property
    def tool_calls_parsed(self) -> bool | None:
        """Every scripted tool call came back as a call (None: no tool-call run)."""
        verdicts = [r.calls_parsed for r in self.rows if r.calls_parsed is not None]
        return all(verdicts) if verdicts else None

    @property
    def stream_equal(self) -> bool | None:
        """Every streamed reply equals its non-streamed twin (None: none compared)."""
        verdicts = [r.stream_equal for r in self.rows if r.stream_equal is not None]
        return all(verdicts) if verdicts else None

    @property
    def ok(self) -> bool:
        """Token-exact, tool calls parsed as calls, streamed = non-streamed."""
        return (
            self.contiguous
            and self.tool_calls_parsed is not False
            and (self.stream_equal is not False)
        )

    def as_json(self) -> dict[str, Any]:
        keys = (
            "name",
            "api",
            "stream",
            "naive_contiguous",
            "contiguous",
            "calls_parsed",
            "stream_equal",
            "reason",
        )
        return {
            "model": self.model,
            "renderer": self.renderer,
            "path_reason": self.path_reason,
            "contiguous": self.contiguous,
            "tool_calls_parsed": self.tool_calls_parsed,
            "stream_equal": self.stream_equal,
            "ok": self.ok,
            "scenarios": [{k: asdict(r)[k] for k in keys} for r in self.rows],
        }


def format_report(report: Report, seconds: float | None = None) -> str:
    lines = [
        f"model:    {report.model}",
        f"path:     {path_label(report.renderer)}",
        f"why:      {report.path_reason}",
        "",
    ]
    width = max([len(r.name) for r in report.rows] + [8])
    lines.append(f"{'scenario':<{width}}  {'api':<9}  {'stream':<6}  {'naive':<6}  tokenkeep")
    for r in report.rows:
        lines.append(
            f"{r.name:<{width}}  {r.api:<9}  {'yes' if r.stream else 'no':<6}  "
            f"{'ok' if r.naive_contiguous else 'BREAK':<6}  {'ok' if r.contiguous else 'BREAK'}"
        )
        if r.tokenkeep_reason:
            lines.append(f"    tokenkeep: {r.tokenkeep_reason}")
        if r.calls_parsed is False:
            lines.append(f"    TOOL CALL NOT PARSED: the harness got {r.first_reply}")
        if r.stream_equal is False:
            lines.append("    STREAMED != NON-STREAMED: see --json")
    naive_reasons = {r.name: r.naive_reason for r in report.rows if r.naive_reason}
    if naive_reasons:
        lines += ["", "naive re-render breaks (first one per scenario):"]
        lines += [f"  {name}: {why}" for name, why in naive_reasons.items()]
    if report.skipped:
        lines += ["", "not applicable to this template:"]
        lines += [f"  {name}: {why}" for name, why in report.skipped.items()]
    naive_broken = sum(not r.naive_contiguous for r in report.rows)
    kept = sum(r.contiguous for r in report.rows)
    timing = f" in {seconds:.1f} s" if seconds is not None else ""
    verdict = "CONTIGUOUS" if report.contiguous else "BREAKS"
    if report.contiguous and not report.ok:
        verdict = "REPLIES WRONG"
    parsed = {True: "yes", False: "NO", None: "n/a (no tool-call scenario)"}
    lines += [
        "",
        f"tool calls parsed as calls: {parsed[report.tool_calls_parsed]}",
        f"streamed = non-streamed:    {parsed[report.stream_equal]}",
        f"verdict: {verdict}: tokenkeep kept {kept} of {len(report.rows)} runs token-exact; "
        f"a naive re-render broke {naive_broken}{timing}",
    ]
    return "\n".join(lines)


def path_label(renderer: str) -> str:
    if renderer == GENERIC:
        return "generic end-of-turn splice (no hand-written renderer for this family)"
    return f"hand-written renderer {renderer!r}"
