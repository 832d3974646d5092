"""The options of a conversion, in one object built by keyword once: by the CLI from its options (same names,
`ConvertOptions.pick`) or by a library caller through `convert(..., **options)`.

A library caller passes what Python code holds: torch dtypes or their names (`quant_storage=torch.uint8` or
"uint8"), one `skip` pattern or several, a `torch.device`. A refusal names the option as its caller wrote it:
`--quant-type nf5` for the CLI, `quant_type='nf5'` for Python."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from ..bnb.format import CHOICES, Settings, choice
from ..bnb.loading import skip_problem
from ..checkpoint.dtypes import torch_name
from ..errors import UsageError, flag, spelled
from ..source.spec import is_repo_id
from .plan import parse_size

_DEVICE = re.compile(r"^(auto|(cpu|cuda)(:\d+)?)$")


@dataclass(frozen=True, kw_only=True)
class ConvertOptions:
    """Every option of `prequant convert`, by the CLI's names (`prequant convert --help` says what each does).

    Checked on creation (a UsageError names the option), so a conversion never starts with a bad one."""

    quant_type: str = "nf4"
    double_quant: bool = True
    blocksize: int = 64
    compute_dtype: str | torch.dtype = "bfloat16"  # a torch dtype is kept as its name ("bfloat16")
    quant_storage: str | torch.dtype = "bfloat16"
    quantize_experts: bool = False  # MoE expert weights 4-bit too, each under its own name (`bnb.experts`)
    skip: tuple[str, ...] | str = ()  # more modules to keep unquantized (transformers' llm_int8_skip_modules matching)
    max_shard_size: str | int = "5GB"
    device: str | torch.device = "auto"
    dry_run: bool = False
    overwrite: bool = False
    resume: bool = False
    trust_remote_code: bool = False
    progress: bool = True  # progress on stderr (the library's callers may turn it off; the CLI always shows it)
    stats: bool = True
    push_to_hub: str | None = None
    private: bool = False  # push_to_hub creates the repo private
    delete_source_shards: bool = False
    allow_nan: bool = False  # copy a kept tensor holding NaN as it is (recorded in prequant.json) instead of refusing
    base_model: str | None = None  # the card's base_model (a Hub repo id) for a local source; a Hub source's own

    def __post_init__(self) -> None:
        given = {name: getattr(self, name) for name in ("compute_dtype", "quant_storage")}
        for name, value in given.items():
            if isinstance(value, torch.dtype):
                object.__setattr__(self, name, torch_name(value))
        skip = (self.skip,) if isinstance(self.skip, str) else self.skip or ()
        if not isinstance(skip, (list, tuple, set, frozenset)) or not all(isinstance(p, str) for p in skip):
            raise UsageError(f"{self.said('skip', self.skip)} is not a module name or pattern; pass a string or a list "
                             f"of strings, e.g. {self.said('skip', ['lm_head'])}")  # the CLI's are strings
        object.__setattr__(self, "skip", tuple(skip))
        if self.private and not self.push_to_hub:
            raise UsageError(f"{flag('private')} applies to the repo that {flag('push_to_hub', None)} creates; "
                             "pass that too, or leave it "
                             "out (`prequant upload --private` uploads a finished output)")
        if isinstance(self.device, torch.device):
            object.__setattr__(self, "device", str(self.device))
        for name in CHOICES:
            object.__setattr__(self, name, choice(name, getattr(self, name), given=given.get(name)))
        if not isinstance(self.device, str) or not _DEVICE.match(self.device):
            raise UsageError(f"{self.said('device', self.device)} is not a device; use auto, cpu or cuda[:N]")
        if self.base_model is not None and not is_repo_id(self.base_model):
            raise UsageError(f"{self.said('base_model', self.base_model)} is not a Hub repo id; write it as org/name")
        parse_size(self.max_shard_size, self.said("max_shard_size", self.max_shard_size))
        for pattern in self.skip:  # transformers compiles each as a regex when it loads the output
            if problem := skip_problem(pattern):
                raise UsageError(f"{self.said('skip', pattern)} {problem}")

    def said(self, name: str, value: object) -> str:
        """Option `name` given `value`, as this object's caller writes it (see `spelled`)."""
        return spelled(name, value)

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
        """The options of the CLI's `convert`, from its arguments (`values`: by the same names, others ignored);
        a refusal names them as its flags."""
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})


