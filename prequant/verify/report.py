"""What verify found: a Report of problems and warnings, each naming the file or tensor it is about, and the
error that carries a failed report to the CLI."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import PrequantError


@dataclass(frozen=True)
class Problem:
    """One finding: the file or tensor it is about, and what is wrong (with the fix when there is one)."""

    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass
class Report:
    """What verify found; `ok` only when there is no problem (warnings do not fail)."""

    output_dir: str
    problems: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    files: dict = field(default_factory=dict)
    extra_files: list[str] = field(default_factory=list)
    listed_files: list[str] = field(default_factory=list)  # what prequant.json lists (what upload sends)
    tensors: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    conversion_stats: dict | None = None
    source: dict | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def fail(self, where: str, message: str) -> None:
        self.problems.append(Problem(where, message))

    def warn(self, where: str, message: str) -> None:
        self.warnings.append(Problem(where, message))

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "output_dir": self.output_dir,
            "problems": [vars(p) for p in self.problems],
            "warnings": [vars(p) for p in self.warnings],
            "files": self.files,
            "extra_files": self.extra_files,
            "tensors": self.tensors,
            "config": self.config,
            "conversion_stats": self.conversion_stats,
            "source": self.source,
        }

    def to_text(self) -> str:
        status = "OK" if self.ok else f"FAILED ({count(len(self.problems), 'problem')})"
        lines = [f"verify {self.output_dir}: {status}"]
        if self.files:
            f = self.files
            lines.append(
                f"  files: {f['checked']} of {f['listed']} listed in prequant.json match (size and sha256, "
                f"{f['bytes_hashed'] / 1e9:.3f} GB hashed)"
            )
        if self.tensors:
            t = self.tensors
            lines.append(
                f"  tensors: {count(t['count'], 'key')} in {count(t['shards'], 'shard')}, {t['quantized']} quantized "
                f"({', '.join(t['quant_types']) or '-'}), index {'consistent' if t['index_ok'] else 'INCONSISTENT'}"
            )
        if self.config:
            lines.append(f"  config.json: {self._config_text()}")
        if self.conversion_stats and self.conversion_stats.get("tensors"):
            c = self.conversion_stats
            lines.append(
                f"  recorded at conversion: relative error median {c['median_rel_error']}, max "
                f"{c['max_rel_error']} ({c['max_rel_error_tensor']})"
            )
        if self.source:
            lines.append(f"  {self._source_text()}")
        lines += [f"  FAIL {p}" for p in self.problems]
        lines += [f"  warning {p}" for p in self.warnings]
        return "\n".join(lines)

    def _config_text(self) -> str:
        if "quantization_config" in self.config:
            return f"quantization_config {'agrees with' if self.config['ok'] else 'DISAGREES with'} the tensors"
        return "no quantization_config, and no 4-bit tensor" if self.config["ok"] else "FAILED (see below)"

    def _source_text(self) -> str:
        s = self.source
        kept = f"{count(s['kept'], 'kept tensor')} compared byte for byte"
        summary = s["summary"]
        if not summary.get("tensors"):
            return f"source {s['spec']}: no quantized tensor compared, {kept}"
        return (f"source {s['spec']}: {count(s['quantized'], 'quantized tensor')} compared (relative error median "
                f"{summary['median_rel_error']}, max {summary['max_rel_error']} ({summary['max_rel_error_tensor']}); "
                f"limit {s['limit']}), {kept}")


def count(n: int, noun: str) -> str:
    """'1 problem', '2 problems', '1 kept tensor', '0 keys': a count and its noun, plural when it is not one."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


class VerificationFailed(PrequantError):
    """verify found problems; the message names the first one."""

    def __init__(self, report: Report, action: str = "verification failed") -> None:
        more = len(report.problems) - 1
        tail = f" (and {count(more, 'more problem')}; see the full report)" if more else ""
        super().__init__(f"{action}: {report.problems[0]}{tail}")
        self.report = report
