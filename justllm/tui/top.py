"""``justllm top``: a live dashboard of a running server, polled from its ``/metrics``.

The app never blocks on the network: each poll is an async worker, at most one in flight, with
a timeout; a server that is down or answers badly only changes the status line, and polling
goes on. Everything shown comes from one :class:`~justllm.tui.metrics.Snapshot` per poll.

A page of several models (a gateway's, ``justllm serve --models``) adds a models table, one row
per model; the panels below it show one view, every model summed ("all models", the default)
or the model picked in the table. Each view keeps its own tokens/s history, computed from its
own counter, so switching views never joins two counters into a fake peak.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections import deque
from collections.abc import Callable

import httpx
from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.timer import Timer
from textual.widget import Widget
from textual.widgets import DataTable, Digits, Footer, Header, Sparkline, Static

from justllm.tui.metrics import Snapshot, metrics_url, parse, rate

DEFAULT_URL = "http://127.0.0.1:8080"
ALL_MODELS = "all models"
# The models table: (column key, label, width). Names longer than the first column are cut.
MODEL_COLUMNS = (("model", "model", 20), ("state", "state", 8), ("replicas", "repl", 5),
                 ("running", "run", 4),
                 ("waiting", "wait", 4), ("kv", "KV", 6), ("hit", "hit", 6), ("tok_s", "tok/s", 7))


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.2f}"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _several_models(snap: Snapshot | None) -> bool:
    """A gateway's page (even with one model configured) or one with several models' series."""
    return snap is not None and (snap.gateway or len(snap.per_model) > 1)


def _replicas(m: Snapshot) -> str:
    """Replicas in the rotation: a count, or by role for a disaggregated model ("1P 2D")."""
    roles = dict(m.replicas_up)
    if not roles:
        return "-"
    if set(roles) == {"both"}:
        return str(roles["both"])
    return " ".join(f"{roles[r]}{r[0].upper()}" for r in ("prefill", "decode", "both")
                    if r in roles)


def _cut(name: str, width: int) -> str:
    return name if len(name) <= width else name[:width - 1] + "…"


class BlockBar(Widget):
    """One line: KV blocks held by the prefix cache, used by requests, and free."""

    DEFAULT_CSS = "BlockBar { height: 1; }"

    used: reactive[float | None] = reactive(None)
    total: reactive[float | None] = reactive(None)
    cache: reactive[float | None] = reactive(None)

    def render(self) -> Text:
        width = max(self.size.width, 1)
        if not self.total or self.used is None:
            return Text("░" * width, style="dim")
        used = min(max(self.used, 0.0), self.total)
        cache = min(max(self.cache or 0.0, 0.0), used)  # the cache's blocks are part of "used"
        used_cells = round(width * used / self.total)
        cache_cells = min(round(width * cache / self.total), used_cells)
        fraction = used / self.total
        busy = "red" if fraction >= 0.9 else "yellow" if fraction >= 0.7 else "green"
        return Text.assemble(("█" * cache_cells, "magenta"),
                             ("█" * (used_cells - cache_cells), busy),
                             ("░" * (width - used_cells), "dim"))


class TopApp(App[None]):
    """Polls ``url``/metrics every ``interval`` seconds and shows what the server is doing."""

    CSS_PATH = "top.tcss"
    TITLE = "justllm top"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        # As in top and htop (Textual's own Ctrl-C only says to press Ctrl-Q).
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True),
        Binding("p", "toggle_pause", "Pause/resume"),
        Binding("a", "all_models", "All models"),
        Binding("m", "next_model", "Next model"),
    ]

    snapshot: reactive[Snapshot | None] = reactive(None, always_update=True)
    status: reactive[str] = reactive("connecting")
    reachable: reactive[bool | None] = reactive(None)
    paused: reactive[bool] = reactive(False)
    selected: reactive[str | None] = reactive(None)  # the model the panels show; None: all

    def __init__(self, url: str = DEFAULT_URL, interval: float = 1.0,
                 api_key: str | None = None, history: int = 120,
                 clock: Callable[[], float] = time.monotonic) -> None:
        # Until on_mount the widgets a watcher updates do not exist (App.is_mounted is another
        # thing: whether a given widget is mounted).
        self._widgets_ready = False
        super().__init__()
        if interval <= 0:
            raise ValueError("the interval must be > 0 seconds")
        self.url = url.rstrip("/")
        # (an OpenAI client's base URL, .../v1, as chat and bench take it: /v1/metrics is 404)
        self.metrics_url = metrics_url(self.url)
        self.interval = interval
        self.api_key = api_key
        self.history = history
        # Tokens/s per view: None for all models (the only one a single model's page shows).
        self.histories: dict[str | None, deque[float]] = {}
        self.polls = 0  # attempts so far, answered or not
        self.clock = clock
        # The baseline of the next rate: None after start, an outage or a pause, so the first
        # reading after one only sets it. ``_epoch`` changes with each of those, so a reply to
        # a poll sent before one does not become a baseline either.
        self._prev: Snapshot | None = None
        self._epoch = 0
        # Whether the newest tokens/s sample is of now: not after an outage or a pause until
        # a reading adds one (the rate from before it was shown as the current one).
        self._current = False
        self._client: httpx.AsyncClient | None = None
        self._timer: Timer | None = None
        self._in_flight = False

    @property
    def rates(self) -> deque[float]:
        """The tokens/s history of the view the panels show."""
        return self._history(self.selected)

    def _history(self, view: str | None) -> deque[float]:
        return self.histories.setdefault(view, deque(maxlen=self.history))

    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical(id="models-panel", classes="panel") as models:
            models.border_title = "models"
            models.border_subtitle = "↑↓ enter: show · a: all"
            table: DataTable[str | Text] = DataTable(id="models", cursor_type="row")
            for key, label, width in MODEL_COLUMNS:
                header = label if key in ("model", "state", "replicas") else Text(label, justify="right")
                table.add_column(header, key=key, width=width)
            yield table
        with Horizontal(id="upper"):
            with Vertical(id="cache", classes="panel") as cache:
                cache.border_title = "prefix cache hit ratio"
                yield Digits("-", id="hit-ratio")
                yield Static("hits - · misses -", id="hit-detail")
                yield Static(id="cache-blocks")
            with Vertical(id="requests", classes="panel") as requests:
                requests.border_title = "requests"
                yield Static(id="running")
                yield Static(id="waiting")
                yield Static(id="ttft-p50")
                yield Static(id="ttft-p99")
                yield Static(id="spec")
        with Vertical(id="kv", classes="panel") as kv:
            kv.border_title = "KV blocks"
            yield BlockBar(id="kv-bar")
            yield Static(id="kv-detail")
        with Vertical(id="tokens", classes="panel") as tokens:
            tokens.border_title = "generation tokens/s"
            yield Static("-", id="tok-rate")
            yield Sparkline([], id="tok-spark")
        with Horizontal(id="status-bar"):
            yield Static(id="status")
            yield Static("PAUSED (p resumes)", id="paused")
        yield Footer()

    def on_mount(self) -> None:
        self._widgets_ready = True
        self.sub_title = self.url
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        # A hung server must not pile up polls: one in flight at most, and it gives up in time.
        timeout = httpx.Timeout(max(2.0, self.interval), connect=min(2.0, max(0.5, self.interval)))
        self._client = httpx.AsyncClient(headers=headers, timeout=timeout)
        self._show(None)
        self._show_status()
        self._timer = self.set_interval(self.interval, self.poll)
        self.poll()
        self._exit_on_signals(add=True)

    async def on_unmount(self) -> None:
        self._exit_on_signals(add=False)
        if self._client is not None:
            await self._client.aclose()

    def _exit_on_signals(self, *, add: bool) -> None:
        """SIGTERM (``timeout``, ``kill``) and SIGHUP (a closed pane or terminal) end the app
        as ``q`` does, so the terminal gets its screen and mouse back; their default ended
        the process with the alternate screen and mouse reporting left on. Where the loop
        cannot take signal handlers (not the main thread), nothing changes."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGHUP):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                if add:
                    loop.add_signal_handler(sig, self.exit)
                else:
                    loop.remove_signal_handler(sig)

    def poll(self) -> None:
        if self.paused or self._in_flight:
            return
        self._in_flight = True
        self.fetch()

    @work(exclusive=True, group="poll", exit_on_error=False)
    async def fetch(self) -> None:
        self.polls += 1
        epoch = self._epoch
        try:
            assert self._client is not None
            try:
                response = await self._client.get(self.metrics_url)
            except httpx.HTTPError as e:
                self._down(f"cannot reach {self.url} ({type(e).__name__})")
                return
            if response.status_code != 200:
                self._down(f"HTTP {response.status_code} from {self.metrics_url}"
                           + (" (wrong or missing --api-key?)" if response.status_code in (401, 403)
                              else ""))
                return
            try:
                snap = parse(response.text, self.clock())
            except ValueError as e:
                self._down(f"{self.metrics_url} is not a Prometheus page ({e})")
                return
            self.reachable = True
            if snap.gateway:
                loaded = sum(1 for m in snap.per_model.values() if m.loaded)
                self.status = f"connected · gateway, {loaded}/{len(snap.per_model)} models loaded"
            elif snap.empty:
                self.status = "connected, no metrics yet (is the model still loading?)"
            else:
                models = ", ".join(snap.models)
                self.status = f"connected{' · ' + models if models else ''}"
            self._record(snap, epoch)
        except Exception as e:  # noqa: BLE001 - the dashboard stays up and says what happened
            self._down(f"error: {type(e).__name__}: {e}")
        finally:
            self._in_flight = False

    def _down(self, message: str) -> None:
        self.reachable = False
        self.status = message
        self._new_baseline()
        self.snapshot = None  # (its figures are not the server's now: they stayed on show)

    def _new_baseline(self) -> None:
        self._prev = None
        self._epoch += 1
        self._current = False

    def _record(self, snap: Snapshot, epoch: int) -> None:
        """Show ``snap`` and add its tokens/s sample. A counter moves in bursts (a step's tokens
        at once), so two readings much closer than the interval (the first two polls, a poll
        on resume and the timer's) would make a burst look like a peak: such a reading gives
        no sample and the older baseline is kept."""
        prev = self._prev
        if epoch != self._epoch or self.paused:
            self._prev = None
        elif prev is None or snap.time - prev.time >= self.interval / 2:
            views: dict[str | None, tuple[Snapshot | None, Snapshot]] = {None: (prev, snap)}
            for name, now in snap.per_model.items():
                views[name] = (prev.per_model.get(name) if prev is not None else None, now)
            for view, (before, now) in views.items():
                per_second = rate(before, now, "generation_tokens")
                if per_second is not None:
                    self._history(view).append(per_second)
                    self._current = True
            self._prev = snap
        for gone in [v for v in self.histories if v is not None and v not in snap.per_model]:
            del self.histories[gone]
        if self.selected is not None and self.selected not in snap.per_model:
            self.selected = None  # no longer on the page (another server answers there)
        self.snapshot = snap

    def action_all_models(self) -> None:
        self.selected = None

    def action_next_model(self) -> None:
        """All models, then each model in the table's order, then all models again."""
        views: list[str | None] = [None, *(self.snapshot.per_model if self.snapshot else ())]
        i = views.index(self.selected) if self.selected in views else 0
        self.selected = views[(i + 1) % len(views)]

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("all_models", "next_model"):
            return _several_models(self.snapshot)  # a single model has no views to pick
        return True

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.selected = event.row_key.value

    def watch_selected(self, selected: str | None) -> None:
        if not self._widgets_ready:
            return
        self._show(self.snapshot)
        self._show_status()

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused

    def watch_paused(self, paused: bool) -> None:
        if not self._widgets_ready:
            return
        self.query_one("#paused").display = paused
        if self._timer is not None:
            (self._timer.pause if paused else self._timer.resume)()
        self._new_baseline()  # the first rate after resuming covers one interval, not the pause
        if not paused:
            self.poll()

    def watch_status(self, status: str) -> None:
        self._show_status()

    def watch_reachable(self, reachable: bool | None) -> None:
        self._show_status()

    def _show_status(self) -> None:
        if not self._widgets_ready:
            return
        widget = self.query_one("#status", Static)
        widget.set_class(self.reachable is True, "ok")
        widget.set_class(self.reachable is False, "down")
        icon = {True: "● ", False: "✖ ", None: ""}[self.reachable]
        view = ""
        if _several_models(self.snapshot):
            view = f" · showing {self.selected or ALL_MODELS}"
        self.sub_title = self.url + view
        widget.update(Text(icon + self.status + view))

    def watch_snapshot(self, snap: Snapshot | None) -> None:
        if self._widgets_ready:
            self._show(snap)
            self._show_status()  # whether it names the view depends on the page

    def _show(self, snap: Snapshot | None) -> None:
        several = _several_models(snap)
        panel = self.query_one("#models-panel")
        if panel.display != several:
            panel.display = several
            self.refresh_bindings()
        if several:
            assert snap is not None
            self._show_models(snap)
        s = (snap.per_model.get(self.selected) if snap and self.selected else snap) or Snapshot()
        q = self.query_one
        ratio = q("#hit-ratio", Digits)
        ratio.update(_percent(s.hit_ratio))
        ratio.set_class(s.hit_ratio is not None and s.hit_ratio >= 0.5, "high")
        ratio.set_class(s.hit_ratio is not None and s.hit_ratio < 0.5, "low")
        q("#hit-detail", Static).update(f"hits {_num(s.hits)} · misses {_num(s.misses)}")
        q("#cache-blocks", Static).update(f"holds {_num(s.cache_blocks)} KV blocks")
        q("#running", Static).update(f"{'running':<12}{_num(s.running)}")
        q("#waiting", Static).update(f"{'waiting':<12}{_num(s.waiting)}")
        q("#ttft-p50", Static).update(f"{'TTFT p50':<12}{_seconds(s.ttft_quantile(0.5))}")
        q("#ttft-p99", Static).update(f"{'TTFT p99':<12}{_seconds(s.ttft_quantile(0.99))}")
        q("#spec", Static).update(f"{'spec accept':<12}{_percent(s.spec_acceptance)}")
        bar = q("#kv-bar", BlockBar)
        bar.used, bar.total, bar.cache = s.kv_used, s.kv_total, s.cache_blocks
        usage = f" ({_percent(s.kv_usage)})" if s.kv_usage is not None else ""
        q("#kv-detail", Static).update(Text.assemble(
            f"used {_num(s.kv_used)}/{_num(s.kv_total)}{usage} · ",
            ("■", "magenta"), f" prefix cache {_num(s.cache_blocks)}"))
        rates = self.rates
        current = (f"{rates[-1]:.1f} tok/s" if rates and self._current
                   and s.generation_tokens is not None else "-")
        peak = f" · peak {max(rates):.1f}" if rates else ""
        total = (f" · {_num(s.generation_tokens)} generated"
                 if s.generation_tokens is not None else "")
        q("#tok-rate", Static).update(current + peak + total)
        q("#tok-spark", Sparkline).data = list(rates)

    def _show_models(self, snap: Snapshot) -> None:
        """One row per model, updated in place so the cursor stays where the user left it."""
        table = self.query_one("#models", DataTable)
        rows = {name: self._model_row(name, m) for name, m in snap.per_model.items()}
        if [key.value for key in table.rows] != list(rows):
            table.clear()
            for name, row in rows.items():
                table.add_row(*row, key=name)
            if self.selected in rows:
                table.move_cursor(row=list(rows).index(self.selected))
        else:
            for name, row in rows.items():
                for (column, _, _), value in zip(MODEL_COLUMNS, row):
                    table.update_cell(name, column, value)
        if self.focused is None:
            table.focus()  # hidden until now, so nothing had the keys
        waiting = snap.waiting_for_load
        self.query_one("#models-panel").border_title = (
            f"models · {_num(waiting)} waiting for a load" if waiting else "models")

    def _model_row(self, name: str, m: Snapshot) -> tuple[str | Text, ...]:
        rates = self.histories.get(name)
        tok_s = f"{rates[-1]:.1f}" if rates and m.generation_tokens is not None else "-"
        mark = "▸ " if name == self.selected else "  "
        state = {True: "loaded", False: "unloaded", None: "-"}[m.loaded]
        numbers = (_num(m.running), _num(m.waiting), _percent(m.kv_usage), _percent(m.hit_ratio),
                   tok_s)
        return (Text(mark + _cut(name, MODEL_COLUMNS[0][2] - 2)),  # (a str is read as markup)
                Text(state, style="" if m.loaded else "dim"), _replicas(m),
                *(Text(n, justify="right") for n in numbers))
