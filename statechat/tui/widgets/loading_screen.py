"""LoadingScreen: a progress bar and the current step while the model loads."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Center, Middle
from textual.screen import Screen
from textual.widgets import Label, ProgressBar

from statechat.tui.format import clean

STEPS = ("starting torch", "loading the model", "allocating the caches", "opening conversations")


class LoadingScreen(Screen):
    """Shown until the engine is ready; `advance(step)` moves the bar."""

    def __init__(self, model: str) -> None:
        super().__init__(id="loading")
        self.model = model

    def compose(self) -> ComposeResult:
        """The model's name, the bar and the step under way, centred."""
        with Middle(), Center():
            yield Label(f"statechat: loading {clean(self.model)}", id="loading-title",
                        markup=False)
            yield ProgressBar(total=len(STEPS), show_eta=False, id="loading-bar")
            yield Label(STEPS[0], id="loading-step")

    def advance(self, step: int) -> None:
        """Fill the bar to `step` of STEPS and name the next step."""
        self.query_one(ProgressBar).update(progress=step)
        if step < len(STEPS):
            self.query_one("#loading-step", Label).update(STEPS[step])
