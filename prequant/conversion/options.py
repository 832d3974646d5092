"""The options of a conversion, in one object built by keyword once: by the CLI from its options (same names) or
by a library caller through `convert(..., **options)`."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ..bnb.format import Settings
from ..bnb.loading import skip_problem
from ..errors import UsageError
from .plan import parse_size

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


@dataclass(frozen=True, kw_only=True)
class ConvertOptions:
    """Every option of `prequant convert`, by the CLI's names (`prequant convert --help` says what each does).

    Checked on creation (a UsageError names the option), so a conversion never starts with a bad one."""

    quant_type: str = "nf4"
    double_quant: bool = True
    blocksize: int = 64
    compute_dtype: str = "bfloat16"
    quant_storage: str = "bfloat16"
    quantize_experts: bool = False  # MoE expert weights 4-bit too, each under its own name (`bnb.experts`)
    skip: tuple[str, ...] = ()  # more modules to keep unquantized (transformers' llm_int8_skip_modules matching)
    max_shard_size: str | int = "5GB"
    device: str = "auto"
    dry_run: bool = False
    overwrite: bool = False
    resume: bool = False
    trust_remote_code: bool = False
    progress: bool = True  # progress on stderr (the library's callers may turn it off; the CLI always shows it)
    stats: bool = True
    push_to_hub: str | None = None
    delete_source_shards: bool = False
    allow_nan: bool = False  # copy a kept tensor holding NaN as it is (recorded in prequant.json) instead of refusing
    base_model: str | None = None  # the card's base_model (a Hub repo id) for a local source; a Hub source's own

    def __post_init__(self) -> None:
        object.__setattr__(self, "skip", tuple(self.skip or ()))
        if self.base_model is not None and not _REPO_ID.match(self.base_model):
            raise UsageError(f"--base-model {self.base_model!r} is not a Hub repo id; write it as org/name")
        self.settings  # noqa: B018 - checks the quantization settings
        self.shard_limit  # noqa: B018 - checks the size
        for pattern in self.skip:  # transformers compiles each as a regex when it loads the output
            if problem := skip_problem(pattern):
                raise UsageError(f"--skip {pattern!r} {problem}")

    @property
    def settings(self) -> Settings:
        """The quantization settings (BitsAndBytesConfig's)."""
        return Settings(quant_type=self.quant_type, double_quant=self.double_quant, blocksize=self.blocksize,
                        compute_dtype=self.compute_dtype, quant_storage=self.quant_storage)

    @property
    def shard_limit(self) -> int:
        """--max-shard-size in bytes."""
        return parse_size(self.max_shard_size)

    @classmethod
    def pick(cls, values: Mapping[str, Any]) -> ConvertOptions:
        """The options named in `values` (e.g. a CLI command's arguments), ignoring other names."""
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})
