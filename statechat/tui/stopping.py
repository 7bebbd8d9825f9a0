"""Stopping the streaming reply (StoppingMixin): Esc stops it; at exit it is kept as Esc
keeps it (`_keep_stopped_reply`). Part of the app's replies (replies.py)."""

from __future__ import annotations

import dataclasses
import logging

from statechat.chat.tree import BusyError, DamagedError
from statechat.tui.format import reply_stats
from statechat.tui.widgets.composer import Composer

log = logging.getLogger("statechat.tui")


class StoppingMixin:
    """StatechatApp's stopping of its streaming reply; the app has what RepliesMixin lists,
    and RepliesMixin's `_end_streaming`, `_made_ids`, `_save_reply` and
    `_delete_continuation`."""

    def action_stop(self) -> None:
        """Esc: cancel an edit first (its box is what the user is looking at), else stop the
        streaming reply."""
        composer = self.query_one(Composer)
        if composer.editing:
            composer.end_edit()
        elif self.handle is not None:
            self.handle.abort()

    def action_help_quit(self) -> None:
        """Ctrl+C (Textual's hint that Ctrl+Q quits): while a reply streams, it stops it as
        Esc does, the key that stops a reply in llama.cpp's and mlx-lm's chats (the reply
        went on, and the hint spoke of quitting); else the hint. It never quits."""
        if self.handle is None:
            super().action_help_quit()
            return
        self.handle.abort()
        self.notify("Stopped the reply (Esc stops one too; Ctrl+Q quits).")

    def _keep_stopped_reply(self) -> None:
        """At exit, save the reply that was streaming (the engine is shut down: its sequence
        holds the last of it) as Esc leaves one: its text so far and a 'stopped' status. Its
        stream's own `_finish_reply`, too late now, does nothing."""
        handle, reply_id, start = self.handle, self.streaming_reply_id, self.streaming_start
        token_ids, thinking = None, self._end_streaming({})
        if handle.seq is None:  # (the engine refused it: it never began)
            text, stats = start.text, {"error": "statechat quit before the reply began"}
        else:
            output = self.worker.engine.output(handle.seq)
            text = self._continued(start, output.text, output.token_ids)
            reason = output.finish_reason or "abort"  # (the engine did not stop in time)
            output = dataclasses.replace(output, finish_reason=reason)
            stats = reply_stats(output, len(start.token_ids), self.worker.max_model_len)
            token_ids = self._made_ids(start, output, handle.params, text)
        try:
            if start.adds_nothing(text, stats.get("finish_reason")):  # (it ended as Ctrl+Q came)
                self._delete_continuation(reply_id, start.of)
            else:
                self._save_reply(reply_id, text, {**stats, **thinking}, token_ids)
        except DamagedError:  # (what ended the app, said in its line already)
            pass
        except BusyError as e:  # (a full disk: said once the app has closed, log_notices.py)
            log.warning("statechat: the reply streaming as the app quit was not saved (%s); "
                        "what was saved of it as it streamed is kept, as unfinished", e)
