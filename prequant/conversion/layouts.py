"""The layout a conversion runs on: transformers' own, predicted from names where the rules are known.

transformers' answer (`bnb.layout.analyze`: the layout child's, else in-process in a thread) takes seconds of
imports. Three cases, by what `bnb.predict` knows of the checkpoint:

- settled (`predict.settled`: a known architecture on a verified transformers, every tensor the parameter the
  model holds, in its shape): the prediction is transformers' layout, and nothing waits for transformers;
- predicted: the conversion starts on the prediction and `confirm()` waits for transformers before anything is
  published, so transformers' layout always wins. When it differs (or transformers refuses the checkpoint,
  e.g. a tensor shaped otherwise than its parameter), `confirm()` raises, and nothing predicted is ever
  published: `convert()` starts again on transformers' layout, or reports transformers' error as it always has;
- neither (or a dry run, a --resume whose journal fixes the plan, a run that deletes its downloaded shards,
  when not settled): transformers decides first.
"""

from __future__ import annotations

import threading
from pathlib import Path

from ..bnb.layout import Layout, analyze
from ..bnb.predict import Prediction
from ..checkpoint.tensors import TensorRef
from ..util import trace
from . import layout_worker


class LayoutMismatch(Exception):
    """transformers decided another layout than the predicted one (never seen by users: convert() restarts)."""


class Layouts:
    """The predicted layout (`first`) and transformers' (`final()`), decided in the background."""

    def __init__(self, prediction: Prediction, config: dict, source_dir: Path, tensors: list[TensorRef],
                 skip: list[str], trust_remote_code: bool) -> None:
        """`prediction`: what `bnb.predict` made of the names, for the same checkpoint, skip list and trust."""
        self._args = (config, source_dir, tensors, list(skip), trust_remote_code)
        self._final: Layout | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.predicted: Layout | None = None
        self.settled = prediction.settled
        if self.settled:
            self._final = prediction.layout
            layout_worker.drop()  # a child started by the CLI would only take cores from this run
            trace.mark("layout-settled")
            return
        self.predicted = prediction.layout
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
