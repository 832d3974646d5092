"""The layout a conversion runs on: predicted from names at once, transformers' own decided meanwhile.

transformers' answer (`bnb.layout.analyze`: the layout child's, else in-process in a thread) takes seconds of
imports; the pipeline need not wait for it where `bnb.predict` knows the architecture. The conversion starts on
the prediction and `confirm()` waits for transformers before anything is published: transformers' layout
always wins. When it differs (or transformers refuses the checkpoint, e.g. a tensor shaped otherwise than
its parameter), `confirm()` raises, and nothing predicted is ever published: `convert()` starts again on
transformers' layout, or reports transformers' error as it always has. A dry run and --resume (whose
journal fixes the plan) wait for transformers from the start.
"""

from __future__ import annotations

import threading
from pathlib import Path

from ..bnb.layout import Layout, analyze
from ..bnb.predict import predict
from ..checkpoint.tensors import TensorRef
from ..util import trace
from . import layout_worker


class LayoutMismatch(Exception):
    """transformers decided another layout than the predicted one (never seen by users: convert() restarts)."""


class Layouts:
    """The predicted layout (`first`) and transformers' (`final()`), decided in the background."""

    def __init__(self, config: dict, source_dir: Path, tensors: list[TensorRef], skip: list[str],
                 trust_remote_code: bool, *, predicted: bool = True) -> None:
        self._args = (config, source_dir, tensors, list(skip), trust_remote_code)
        self.predicted = predict(config, tensors, list(skip), trust_remote_code) if predicted else None
        self._final: Layout | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if self.predicted is None:
            self._final = self._decide()  # nothing to start on: wait for transformers, as before
        else:
            trace.mark("layout-predicted")
            self._thread = threading.Thread(target=self._background, name="prequant-layout", daemon=True)
            self._thread.start()

    @property
    def first(self) -> Layout:
        """The layout to plan with now: the prediction, else transformers' own."""
        return self.predicted if self.predicted is not None else self.final()

    @property
    def pending(self) -> bool:
        """Whether the conversion runs on a prediction that `confirm()` has not yet checked."""
        return self.predicted is not None and self._thread is not None

    def final(self) -> Layout:
        """transformers' layout (waits for it); raises what deciding it raised (e.g. a shape refusal)."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._final is not None
        return self._final

    def confirm(self) -> None:
        """Before publishing: transformers' layout is the predicted one, else LayoutMismatch (or its error)."""
        if self.predicted is None:
            return
        final = self.final()
        self._thread = None
        if final != self.predicted:
            trace.mark("layout-mismatch")
            raise LayoutMismatch(f"predicted {self.predicted.method}, transformers decided otherwise")
        trace.mark("layout-confirmed")

    def _decide(self) -> Layout:
        config, source_dir, tensors, skip, trust = self._args
        return (layout_worker.take(source_dir, tensors, skip, trust)
                or analyze(config, source_dir, tensors, skip, trust))

    def _background(self) -> None:
        try:
            self._final = self._decide()
        except BaseException as e:  # noqa: BLE001 - raised where the conversion asks for the answer
            self._error = e
