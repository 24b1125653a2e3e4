"""DetokenizerManager: token ids in, text out (SGLang: managers/detokenizer_manager.py).

The scheduler sends each request's new token ids (``BatchTokenIDOut``); this turns
them into text incrementally and hands back ``BatchStrOut``. In SGLang it is its own
process between the scheduler and the TokenizerManager; sglite's offline Engine calls
it in-process, and ``sglite serve`` (issue 23) runs it as a process.

Incremental decoding keeps SGLang's two offsets per request: text is decoded from
``surr_offset`` (a few tokens of context, so byte-level BPE joins characters correctly)
and only what lies past ``read_offset`` is new. Text that ends in an incomplete UTF-8
character ("\\ufffd") waits for the next token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sglite import events as ev
from sglite.managers.io_struct import BatchStrOut, BatchTokenIDOut

if TYPE_CHECKING:
    from sglite.model_loader.tokenizer import Tokenizer
    from sglite.server_args import PortArgs


@dataclass
class DecodeStatus:
    """One request's detokenizing state (SGLang's DecodeStatus)."""

    decoded_text: str = ""  # the text of decode_ids[:read_offset]
    decode_ids: list[int] = field(default_factory=list)
    surr_offset: int = 0
    read_offset: int = 0
    sent_offset: int = 0  # decoded_text[:sent_offset] went out already


def stop_str_holdback(text: str, stop_strs: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could start a stop string: they are
    not sent until it is clear they are not part of one."""
    best = 0
    for stop in stop_strs:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


class DetokenizerManager:
    def __init__(self, tokenizer: "Tokenizer | None", event_bus: ev.EventBus | None = None):
        self.tokenizer = tokenizer
        self.event_bus = event_bus or ev.EventBus()
        self.decode_status: dict[str, DecodeStatus] = {}  # unfinished requests only

    def handle_batch_token_id_out(self, recv: BatchTokenIDOut) -> BatchStrOut:
        """Append the request's new tokens; return the text that is now final."""
        status = self.decode_status.setdefault(recv.rid, DecodeStatus())
        status.decode_ids += recv.new_token_ids
        self._decode(status, recv.skip_special_tokens, flush=recv.finished)
        text = status.decoded_text
        if recv.matched_stop_str is not None:
            pos = text.find(recv.matched_stop_str, max(0, status.sent_offset - len(recv.matched_stop_str)))
            if pos != -1:
                text = text[:pos]
        end = len(text) if recv.finished else len(text) - stop_str_holdback(text, recv.stop_strs)
        new_text = text[status.sent_offset : end] if end > status.sent_offset else ""
        status.sent_offset = max(status.sent_offset, end)
        if recv.finished:
            del self.decode_status[recv.rid]
        if recv.new_token_ids:
            self.event_bus.emit(ev.TokensEmitted, rid=recv.rid, token_ids=tuple(recv.new_token_ids), text=new_text)
        return BatchStrOut(recv.rid, new_text, list(recv.new_token_ids), recv.finished, recv.meta_info, recv.logprobs)

    def _decode(self, status: DecodeStatus, skip_special_tokens: bool, flush: bool) -> None:
        """Move read_offset to the end when the new bytes form whole characters (always
        when ``flush``: the request finished)."""
        if self.tokenizer is None:
            return
        ids = status.decode_ids
        surr_text = self.tokenizer.decode(ids[status.surr_offset : status.read_offset],
                                          skip_special_tokens=skip_special_tokens)
        new_text = self.tokenizer.decode(ids[status.surr_offset :], skip_special_tokens=skip_special_tokens)
        if flush or (len(new_text) > len(surr_text) and not new_text.endswith("\ufffd")):
            status.decoded_text += new_text[len(surr_text) :]
            status.surr_offset, status.read_offset = status.read_offset, len(ids)


def run_detokenizer_process(tokenizer: "Tokenizer | None", port_args: "PortArgs") -> None:
    """The DetokenizerManager as a process (``sglite serve``): token ids from the
    Scheduler in, text to the TokenizerManager out, one message per scheduler iteration."""
    import os
    import signal

    import setproctitle
    import zmq

    setproctitle.setproctitle("sglite::detokenizer")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the server stops this process (it exits with its parent)
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.bind(port_args.detokenizer_ipc_name)
    send = ctx.socket(zmq.PUSH)
    send.connect(port_args.tokenizer_ipc_name)
    manager = DetokenizerManager(tokenizer)
    parent = os.getppid()
    while os.getppid() == parent:  # the server went away: so does its detokenizer
        if recv.poll(500):
            send.send_pyobj([manager.handle_batch_token_id_out(out) for out in recv.recv_pyobj()])
