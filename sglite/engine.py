"""Engine: the in-process API, mirroring SGLang's offline engine (SGLang: entrypoints/engine.py).

``generate`` drives the scheduler until its requests finish; ``submit`` + ``step`` run
exactly one scheduler iteration at a time, for the TUI, the walkthroughs and tests.
"""

from __future__ import annotations

import gc
import itertools
import logging
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

from sglite.events import EventBus
from sglite.managers.detokenizer_manager import DetokenizerManager
from sglite.managers.io_struct import AbortReq, BatchStrOut, BatchTokenIDOut, TokenizedGenerateReqInput
from sglite.managers.scheduler import Scheduler
from sglite.sampling.sampling_params import SamplingParams
from sglite.server_args import DEFAULT_MODEL, ServerArgs

Prompt = str | list[str] | None


@dataclass
class ReqState:
    """What the Engine has collected of one request (SGLang's TokenizerManager keeps a
    ReqState per rid too)."""

    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    meta_info: dict[str, Any] = field(default_factory=dict)
    finished: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The result as ``generate`` returns it (plus ``error`` for a rejected request)."""
        out = {"text": self.text, "output_ids": list(self.output_ids), "meta_info": dict(self.meta_info)}
        if "error" in self.meta_info:
            out["error"] = self.meta_info["error"]
        return out


class Engine:
    def __init__(self, model_path: str = DEFAULT_MODEL, event_bus: EventBus | None = None, **kwargs: Any):
        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        _setup_logging(self.server_args.log_level)
        self.event_bus = event_bus or EventBus()
        self.scheduler = Scheduler(self.server_args, event_bus=self.event_bus)
        self.tokenizer = self.scheduler.tokenizer
        # in-process here; its own process under `sglite serve`
        self.detokenizer = DetokenizerManager(self.tokenizer, self.event_bus)
        self.scheduler.send_to_detokenizer = self._detokenize
        self._event_loop = self.scheduler.event_loop()
        self._outputs: list[BatchStrOut] = []  # this iteration's, from the detokenizer
        self._rid_counter = itertools.count()
        self._results: dict[str, ReqState] = {}
        self._lock = threading.RLock()
        self._froze_gc = False  # freeze_gc was called: shutdown gives the heap back

    # --- building requests ------------------------------------------------------------

    def _tokenize(self, prompt: str | None, input_ids: list[int] | None, messages: list[dict] | None,
                  sampling_params: dict[str, Any] | None, rid: str | None, stream: bool) -> TokenizedGenerateReqInput:
        rid = rid if rid is not None else f"r{next(self._rid_counter)}"
        error = None
        ids: list[int] = []
        text = prompt
        try:
            params = SamplingParams.from_dict(sampling_params)
        except (TypeError, ValueError) as e:
            params, error = SamplingParams(), str(e)
        if error is None:
            try:
                if messages is not None:
                    text = self._need_tokenizer().apply_chat_template(messages, add_generation_prompt=True)
                if input_ids is not None:
                    ids = [int(t) for t in input_ids]
                elif text is not None:
                    ids = self._need_tokenizer().encode(text) if text else []
                else:
                    error = "give a prompt, chat messages or input_ids"
            except (ValueError, TypeError, KeyError) as e:
                error = f"could not build the prompt: {e}"
        return TokenizedGenerateReqInput(rid, text, ids, params, stream, error)

    def _need_tokenizer(self):  # noqa: ANN202
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass input_ids")
        return self.tokenizer

    def submit(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
               messages: list[dict] | None = None, sampling_params: dict[str, Any] | None = None,
               rid: str | None = None, stream: bool = False) -> str:
        """Queue one request for the next iteration; returns its rid."""
        req = self._tokenize(prompt, input_ids, messages, sampling_params, rid, stream)
        with self._lock:
            self._results[req.rid] = ReqState()
        self.scheduler.send(req)
        return req.rid

    def step(self) -> list[BatchStrOut]:
        """Run exactly one scheduler iteration; what the requests produced in it."""
        with self._lock:
            try:
                next(self._event_loop)
            except BaseException:
                self._event_loop = self.scheduler.event_loop()  # the failed one is closed
                raise
            outputs, self._outputs = self._outputs, []
            for out in outputs:
                state = self._results.setdefault(out.rid, ReqState())
                state.text += out.new_text
                state.output_ids += out.new_token_ids
                if out.finished:
                    state.finished = True
                    state.meta_info = out.meta_info
            return outputs

    def _detokenize(self, out: BatchTokenIDOut) -> None:
        self._outputs.append(self.detokenizer.handle_batch_token_id_out(out))

    def result(self, rid: str) -> dict[str, Any]:
        return self._results[rid].to_dict()

    def is_finished(self, rid: str) -> bool:
        return self._results[rid].finished

    # --- generate ---------------------------------------------------------------------

    def generate(self, prompt: Prompt = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, messages: list[dict] | None = None,
                 stream: bool = False, rid: str | list[str] | None = None) -> Any:
        """Returns a dict (or a list of dicts for a batch) with text, output_ids and
        meta_info; with stream=True, an iterator of increments."""
        is_batch = isinstance(prompt, list) or (
            isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list))
        n = len(prompt) if isinstance(prompt, list) else len(input_ids) if is_batch else 1  # type: ignore[arg-type]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        if len(params) != n:
            raise ValueError(f"{len(params)} sampling_params for {n} prompts")
        rids_in = rid if isinstance(rid, list) else [rid] * n if n == 1 else [None] * n
        rids = []
        for i in range(n):
            p = prompt[i] if isinstance(prompt, list) else prompt
            ids = input_ids[i] if is_batch and input_ids is not None else (None if is_batch else input_ids)
            rids.append(self.submit(p, input_ids=ids, messages=messages, sampling_params=params[i],
                                    rid=rids_in[i], stream=stream))
        if stream:
            return self._stream(rids, is_batch)
        self._run_until_finished(rids)
        results = [self.result(r) for r in rids]
        for r in rids:
            self._results.pop(r, None)
        return results if is_batch else results[0]

    def _run_until_finished(self, rids: list[str]) -> None:
        while not all(self.is_finished(r) for r in rids):
            had_work = self.scheduler.has_work()
            self.step()
            if not had_work and not all(self.is_finished(r) for r in rids):
                raise RuntimeError("scheduler went idle with unfinished requests: " + ", ".join(
                    r for r in rids if not self.is_finished(r)))

    def _stream(self, rids: list[str], is_batch: bool) -> Iterator[dict[str, Any]]:
        pending = set(rids)
        try:
            while pending:
                had_work = self.scheduler.has_work()
                for out in self.step():
                    if out.rid in pending:
                        chunk = {"text": out.new_text, "output_ids": out.new_token_ids,
                                 "finished": out.finished, "meta_info": out.meta_info}
                        if is_batch:
                            chunk["index"] = rids.index(out.rid)
                        if out.finished:
                            pending.discard(out.rid)
                            if "error" in out.meta_info:
                                chunk["error"] = out.meta_info["error"]
                        yield chunk
                if not had_work and pending:
                    raise RuntimeError("scheduler went idle with unfinished requests")
        finally:
            for r in pending:  # the caller stopped reading: free what they hold
                self.abort(r)
            if pending:
                self.step()
            for r in rids:
                self._results.pop(r, None)

    def abort(self, rid: str) -> None:
        self.scheduler.send(AbortReq(rid))

    def freeze_gc(self) -> int:
        """Move every object alive now out of the cyclic garbage collector's reach, as
        SGLang's ``Engine.freeze_gc`` does: call it after loading and a warm-up, when
        what exists (torch's modules, the model, the pools, the scheduler) lives as long
        as the engine. Full collections otherwise walk all of it: on tiny-random they took
        up to 120 ms each, holding the GIL, a tenth of a short run. Objects made later
        are collected as usual; ``shutdown`` (or ``gc.unfreeze()``) undoes it. Returns
        how many objects were frozen."""
        gc.collect()
        gc.freeze()
        self._froze_gc = True
        frozen = gc.get_freeze_count()
        logging.getLogger(__name__).info("froze %d objects out of garbage collection", frozen)
        return frozen

    def shutdown(self) -> None:
        with self._lock:
            for rid, state in list(self._results.items()):
                if not state.finished:
                    self.abort(rid)
            if self.scheduler.has_work():
                self.step()
            self.scheduler.shutdown()
        if self._froze_gc:
            self._froze_gc = False
            gc.unfreeze()  # frozen objects would outlive the interpreter's last collection

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _setup_logging(level: str) -> None:
    logger = logging.getLogger("sglite")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
    logger.setLevel(level.upper())
