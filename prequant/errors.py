"""prequant's error types: what went wrong, why, and how to fix it, as one line.

An error may carry its parts as data: `where` (the file, tensor or repo it is about) and `detail` (the
problem, without `where`), so that a caller can file it under its own heading (verify's report does) or say
it within the context of what the user asked for (`within`, `noted`) without editing its text.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from contextlib import contextmanager

_command_line = False  # whether the caller is prequant's command line (`command_line()`), else Python code


@contextmanager
def command_line() -> Iterator[None]:
    """Within it, errors name options as the command line spells them (`--skip lm_head`), not as keywords
    (`skip=['lm_head']`): prequant's CLI runs its commands in it. Process-wide, so that the quantizer's and the
    downloads' threads say it too."""
    global _command_line
    before, _command_line = _command_line, True
    try:
        yield
    finally:
        _command_line = before


def on_command_line() -> bool:
    """Whether the caller is prequant's command line (see `command_line`)."""
    return _command_line


def spelled(name: str, value: object) -> str:
    """Option `name` given `value`, as its caller writes it: `--max-shard-size 5GB` (the CLI, quoted for the
    shell where needed) or `max_shard_size='5GB'` (a keyword argument)."""
    if _command_line:
        return f"--{name.replace('_', '-')} {shlex.quote(str(value))}"
    return f"{name}={value!r}"


def flag(name: str, value: bool | None = True) -> str:
    """Option `name` as its caller writes it: a boolean turned on or off (`--overwrite`, `--no-double-quant`; or
    `overwrite=True`, `double_quant=False`), or, with `value` None, the option's name alone (`--quant-type`;
    `quant_type`)."""
    cli = _command_line
    dashed = name.replace("_", "-")
    if value is None:
        return f"--{dashed}" if cli else name
    if cli:
        return f"--{'' if value else 'no-'}{dashed}"
    return f"{name}={value!r}"


def skipping(module: str) -> str:
    """The option that keeps `module` unquantized, as its caller writes it: `--skip lm_head` or `skip=['lm_head']`."""
    return spelled("skip", module if _command_line else [module])


def one_of(allowed: tuple) -> str:
    """'nf4 or fp4', 'bfloat16, float16 or float32': the values an option takes, said."""
    names = [str(a) for a in allowed]
    return f"{', '.join(names[:-1])} or {names[-1]}"


class PrequantError(Exception):
    """An error meant for the user: one line saying what, why and the fix.

    The CLI prints it as ``Error: <message>`` on stderr and exits with ``exit_code``
    (1 for failures, 2 for usage errors), with no traceback unless PREQUANT_DEBUG=1.
    """

    exit_code = 1

    def __init__(self, detail: str, *, where: object = None) -> None:
        self.where = None if where is None else str(where)
        self.detail = detail
        self.context = ""  # what the user asked for, said before the message (see `within`)
        self.note = ""  # said after it (see `noted`)
        super().__init__(self.message)

    @property
    def message(self) -> str:
        """The whole line: context, where, detail, note."""
        core = f"{self.where}: {self.detail}" if self.where else self.detail
        return f"{self.context}{core}{self.note}"

    def __str__(self) -> str:
        return self.message

    def within(self, context: str) -> PrequantError:
        """The same error (type, exit code, parts) said after `context`, e.g. "source 'x' is not a local directory, and "."""
        return self._with(context=context + self.context)

    def noted(self, note: str) -> PrequantError:
        """The same error with `note` said after it, e.g. " (the conversion itself is complete ...)"."""
        return self._with(note=self.note + note)

    def _with(self, **parts: str) -> PrequantError:
        # A copy that skips __init__ (subclasses take other arguments), keeping the cause and traceback.
        err = type(self).__new__(type(self))
        err.__dict__.update(self.__dict__, **parts)
        err.args = (err.message,)
        err.__cause__, err.__traceback__ = self.__cause__, self.__traceback__
        return err

    def __reduce__(self) -> tuple:
        return _restore, (type(self), dict(self.__dict__))


class UsageError(PrequantError):
    """The command line or the options are wrong (exit code 2)."""

    exit_code = 2


class Interrupted(PrequantError):
    """SIGINT or SIGTERM stopped a conversion; the work done so far is kept for the same command to continue."""

    def __init__(self, signal_name: str, exit_code: int) -> None:
        super().__init__(
            f"interrupted by {signal_name}; the work done so far is kept: run the same command again to continue"
        )
        self.exit_code = exit_code


def _restore(cls: type[PrequantError], state: dict) -> PrequantError:
    """Unpickle an error (a child process' error crossing to its parent) without calling its __init__."""
    err = cls.__new__(cls)
    err.__dict__.update(state)
    err.args = (err.message,)
    return err
